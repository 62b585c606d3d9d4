"""The bundled Phi3ForCausalLM (Phi-3, Phi-4) generates like HF transformers' (float32, through its KV
cache): greedy tokens exactly, from a checkpoint holding fused qkv_proj and gate_up_proj, with LongRoPE whose
generation runs past original_max_position_embeddings (HF switches to the long factors there), a sliding
window shorter than the prompts, and Phi-4-mini's partial rotary and tied embeddings; batched and one at a
time (prefix hits), with and without chunked prefill, under tensor parallelism, and with the Triton backend
in Triton's interpreter."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_model_plugins import triton_interpreter  # noqa: F401 - a fixture

from turnout import LLM, SamplingParams, TurnoutError

from tiny_models import TOKENIZER_VOCAB, hf_greedy_cached, write_tokenizer

ORIGINAL, WINDOW, MAX_NEW = 32, 16, 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW = {"dtype": "float32", "cpu_kv_cache_bytes": 1 << 22, "block_size": 4}
ROPE = {  # 12 of each head's 16 dims rotate (partial_rotary_factor 0.75): 6 factors each
    "rope_type": "longrope",
    "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
    "long_factor": [2.0, 4.0, 6.0, 9.0, 14.0, 20.0],
    "original_max_position_embeddings": ORIGINAL,
}

rng = random.Random(3)
# within the original context, generation crossing it: the prefill turns at HF's short factors, the rest at
# the long ones; two lengths, so HF's reference runs as two batches
PROMPTS = [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(n)] for n in [ORIGINAL - 5, ORIGINAL] * 4]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny random checkpoint, weights widened so that logits are far from ties, and HF's tokens."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(
        vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL, sliding_window=WINDOW, partial_rotary_factor=0.75,
        rope_scaling=ROPE, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny_phi3")
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path, hf_greedy_cached(path, PROMPTS, MAX_NEW, attn_implementation="eager")


def _tokens(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_greedy_matches_hf(phi3) -> None:
    """Batched, then two prompts again alone (each a prefix hit), then chunked by a 16-token budget."""
    path, ref = phi3
    assert all(len(p) + MAX_NEW > ORIGINAL for p in PROMPTS)
    llm = LLM(str(path), **KW)
    assert (llm.selection.model.chosen.name, llm.selection.model.chosen.plugin) == ("Phi3ForCausalLM", "phi3")
    assert _tokens(llm, PROMPTS) == ref
    for p, r in zip(PROMPTS[:2], ref[:2]):
        out = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == r and out.num_cached_tokens >= len(p) - 4, out.num_cached_tokens
    chunked = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4, **KW)
    assert max(map(len, PROMPTS)) > 16 and _tokens(chunked, PROMPTS) == ref


def test_tp2_matches_hf(phi3) -> None:
    """Two ranks over gloo, each with its shards of the fused parts, and chunked prefill."""
    path, ref = phi3
    llm = LLM(str(path), tensor_parallel_size=2, max_num_batched_tokens=16, **KW)
    try:
        assert _tokens(llm, PROMPTS) == ref
    finally:
        llm.shutdown()


def test_triton_in_the_interpreter_matches_hf(phi3, triton_interpreter) -> None:  # noqa: F811
    """Triton's kernels (in the interpreter off CUDA) with Phi-3's window: two prompts past it, chunked by a
    16-token budget, the second one's tokens past original_max_position_embeddings; HF's first three tokens
    (the interpreter is slow)."""
    path, ref = phi3
    llm = LLM(str(path), max_num_batched_tokens=16, attention_backend="triton", **KW)
    assert llm.selection.attention.chosen.name == "triton"
    three = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert min(map(len, PROMPTS[:2])) > WINDOW and len(PROMPTS[1]) == ORIGINAL
    assert _tokens(llm, PROMPTS[:2], three) == [r[:3] for r in ref[:2]]


def test_a_fused_tensor_of_the_wrong_size_is_refused_naming_it(phi3, tmp_path: Path) -> None:
    """A qkv_proj short of 16 rows stops start-up with one line naming the checkpoint tensor and its parts."""
    from safetensors.torch import load_file, save_file

    path, _ = phi3
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        TurnoutError, match=rf"checkpoint tensor {name} has 112 rows where config.json gives 64 \+ 32 \+ 32"
    ):
        LLM(str(tmp_path), **KW)
