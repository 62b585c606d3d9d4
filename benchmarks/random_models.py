"""Random-weight checkpoints in real model shapes, for GPU runs where no weights can be downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from tiny_models import _tokenizer  # noqa: E402

SHAPES = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 q heads / 8 kv heads of 128, vocab 151936
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6)),
    # SmolLM2-360M: 32 layers, hidden 960, 15 q heads / 5 kv heads of 64, vocab 49152
    "llama-360m": ("llama", dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                 num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                                 tie_word_embeddings=True, rope_theta=1e5)),
}  # fmt: skip


def make_random_model(path: Path, shape: str, seed: int = 0) -> Path:
    """bf16 weights, N(0, 0.02) like HF's init, saved as safetensors with a small word-level tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if (path / "config.json").exists():
        return path
    arch, kw = SHAPES[shape]
    cfg = (Qwen3Config if arch == "qwen3" else LlamaConfig)(
        max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **kw
    )
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    _tokenizer(path)
    return path
