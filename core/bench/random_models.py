"""Random-weight checkpoints in real model shapes, made on the machine that runs them (no downloads)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("turnout")

SHAPES = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 q heads / 8 kv heads of 128, vocab 151936, tied embeddings
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6)),
    # Qwen3-8B: 36 layers, hidden 4096, 32 q heads / 8 kv heads of 128, vocab 151936, untied
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6)),
    # Llama-3-8B: 32 layers, hidden 4096, 32 q heads / 8 kv heads of 128, vocab 128256
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 tie_word_embeddings=False, rope_theta=5e5)),
    # SmolLM2-360M: 32 layers, hidden 960, 15 q heads / 5 kv heads of 64, vocab 49152
    "llama-360m": ("llama", dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                 num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                                 tie_word_embeddings=True, rope_theta=1e5)),
}  # fmt: skip
SHARD_BYTES = 4 << 30
MAX_POSITIONS = 40960  # Qwen3's max_position_embeddings, in every shape: a 32k-token prompt fits
CHARS = [chr(c) for c in range(32, 127)]  # the tokenizer's last ids, one printable ASCII character each


def random_model_dir(shape: str) -> Path:
    from turnout.loader.default_model import cache_dir

    return cache_dir() / "models" / f"random-{shape}"


def random_model(shape: str) -> Path:
    """The random-weight checkpoint of `shape` in turnout's cache dir, made on first use."""
    return make_random_model(random_model_dir(shape), shape)


def random_config(shape: str) -> Any:
    """The HF config of a shape, with MAX_POSITIONS positions."""
    from transformers import LlamaConfig, Qwen3Config

    arch, kw = SHAPES[shape]
    return (Qwen3Config if arch == "qwen3" else LlamaConfig)(
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **kw
    )


def make_random_model(path: Path, shape: str, seed: int = 0) -> Path:
    """bf16 weights: matrices N(0, 0.02) like HF's init, norms 1. Written tensor by tensor as safetensors
    shards, then a word-level tokenizer over the whole vocabulary, then config.json last: a folder with a
    config.json is complete, and is reused (a folder with fewer positions has them raised to MAX_POSITIONS
    in its config: positions carry no weights; one whose tokenizer cannot spell JSON gets write_tokenizer's,
    its weights untouched)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        _raise_positions(path / "config.json")
        if not spells_json(path):
            write_tokenizer(path, json.loads((path / "config.json").read_text())["vocab_size"])
        return path
    cfg = random_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    names = {k: v.shape for k, v in model.state_dict().items()}
    cfg.architectures, cfg.dtype = [type(model).__name__], "bfloat16"
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    logger.info("writing a random %s checkpoint to %s", shape, path)
    path.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    shards: list[dict] = [{}]
    for name, shp in names.items():
        if len(shp) > 1:
            t = torch.empty(shp, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
        else:
            t = torch.ones(shp, dtype=torch.bfloat16, device=device)
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > SHARD_BYTES:
            shards.append({})
        shards[-1][name] = t.cpu()
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    write_tokenizer(path, cfg.vocab_size)
    cfg.save_pretrained(path)
    return path


def _raise_positions(config_file: Path) -> None:
    cfg = json.loads(config_file.read_text())
    if cfg.get("max_position_embeddings", 0) < MAX_POSITIONS:
        cfg["max_position_embeddings"] = MAX_POSITIONS
        config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id: "<unk>", "<s>", "</s>", then "w3", "w4", ..., and the
    last 95 ids the printable ASCII characters " " to "~", so that JSON can be spelled. Decoding joins the
    tokens' strings as they are, which is how a grammar backend spells them. vocab_size is at least 98."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size - len(CHARS))}}
    vocab = words | {c: vocab_size - len(CHARS) + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def spells_json(path: Path) -> bool:
    """The folder's tokenizer.json has the single-character tokens JSON needs (a missing one counts as
    spelling it: the folder is not one write_tokenizer made)."""
    f = Path(path) / "tokenizer.json"
    return not f.exists() or "{" in json.loads(f.read_text())["model"]["vocab"]
