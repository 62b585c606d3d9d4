"""The bundled Phi3ForCausalLM (Phi-3, Phi-4) generates like HF transformers' (float32, each prompt alone,
eager attention, with its KV cache): greedy tokens exactly, from checkpoints holding fused qkv_proj and
gate_up_proj, with LongRoPE whose generation runs past original_max_position_embeddings (HF switches to
the long factors there), a sliding window shorter than the prompts, Phi-4-mini's partial rotary and tied
embeddings; batched and one at a time (prefix hits), chunked prefill, and tensor parallelism."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams, TurnoutError

from tiny_models import TOKENIZER_VOCAB, _tokenizer

ORIGINAL, WINDOW, MAX_NEW = 32, 16, 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW = {"dtype": "float32", "cpu_kv_cache_bytes": 1 << 22, "block_size": 4}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL}
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0], [1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0, 24.0]
VARIANTS = {  # Phi-3-mini-128k's shape of config (window, LongRoPE) and Phi-4-mini's (partial rotary, tied)
    "phi3": dict(
        sliding_window=WINDOW, rope_scaling={**LONGROPE, "short_factor": SHORT, "long_factor": LONG}
    ),
    "phi4_mini": dict(
        partial_rotary_factor=0.75,  # 12 of 16 dims: 6 factors
        tie_word_embeddings=True,
        rope_scaling={**LONGROPE, "short_factor": SHORT[:6], "long_factor": LONG[2:]},
    ),
}

rng = random.Random(3)
# within the original context, generation crossing it: the prefill has HF's short factors, the rest long
LENGTHS = [rng.randrange(ORIGINAL - MAX_NEW + 2, ORIGINAL + 1) for _ in range(8)]
PROMPTS = [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(n)] for n in LENGTHS]


def _write(path: Path, variant: str) -> Path:
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(
        vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **{"tie_word_embeddings": False, **VARIANTS[variant]},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # widened so that logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    return path


def _hf_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outs = []
    for p in PROMPTS:
        ids, cache, out = torch.tensor([p]), None, []
        with torch.no_grad():
            for _ in range(MAX_NEW):
                res = model(ids, cache=cache, use_cache=True)
                cache, ids = res.past_key_values, res.logits[:, -1:].argmax(-1)
                out.append(int(ids))
        outs.append(out)
    return outs


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = _write(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, _hf_greedy(path)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_greedy_matches_hf(phi3) -> None:
    """Batched, then each prompt again alone (every one a prefix hit), then chunked by a 16-token budget."""
    variant, path, ref = phi3
    assert all(len(p) + MAX_NEW > ORIGINAL for p in PROMPTS)
    llm = LLM(str(path), **KW)
    assert (llm.selection.model.chosen.name, llm.selection.model.chosen.plugin) == ("Phi3ForCausalLM", "phi3")
    assert _tokens(llm, PROMPTS) == ref
    for p, r in zip(PROMPTS, ref):
        out = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == r and out.num_cached_tokens >= len(p) - 4, out.num_cached_tokens
    chunked = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4, **KW)
    assert max(map(len, PROMPTS)) > 16 and _tokens(chunked, PROMPTS) == ref


def test_tp2_matches_hf(phi3) -> None:
    """Two ranks over gloo, chunked prefill, and the first four prompts again as prefix hits."""
    variant, path, ref = phi3
    if variant != "phi3":
        pytest.skip("one variant is enough for the sharding of the fused parts")
    llm = LLM(str(path), tensor_parallel_size=2, max_num_batched_tokens=16, **KW)
    try:
        assert _tokens(llm, PROMPTS) == ref
        again = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in again] == ref[:4] and all(o.num_cached_tokens >= 8 for o in again)
    finally:
        llm.shutdown()


def test_a_fused_tensor_of_the_wrong_size_is_refused_naming_it(phi3, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    variant, path, _ = phi3
    if variant != "phi3":
        pytest.skip("one variant is enough")
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
