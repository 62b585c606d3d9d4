"""Greedy parity with HF transformers (float32, each prompt alone) across batch compositions."""

from __future__ import annotations

import random

import pytest

from turnout import LLM, SamplingParams

from tiny_models import hf_greedy, hf_greedy_cached

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(seed: int, n: int, lo: int, hi: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


COMPOSITIONS = {
    # name: (engine overrides, prompts)
    "mixed_lengths": ({}, _prompts(1, 6, 1, 60)),
    "chunked_prefill": ({"max_num_batched_tokens": 16, "max_num_seqs": 4}, _prompts(2, 5, 20, 70)),
    "preemption": (
        {"num_gpu_blocks_override": 12, "block_size": 4, "max_num_seqs": 8},
        _prompts(3, 6, 4, 14),
    ),
    "prefix_hits": ({"block_size": 4}, _prompts(4, 5, 2, 9, shared_prefix=21)),
}


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3", "tiny_qwen2"])
def model_and_refs(request: pytest.FixtureRequest):
    path = request.getfixturevalue(request.param)
    refs = {name: hf_greedy(path, prompts, MAX_NEW) for name, (_, prompts) in COMPOSITIONS.items()}
    return path, refs


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_greedy_matches_hf(model_and_refs, composition: str) -> None:
    path, refs = model_and_refs
    overrides, prompts = COMPOSITIONS[composition]
    llm = LLM(str(path), cpu_kv_cache_bytes=1 << 22, **overrides)
    if composition == "prefix_hits":  # blocks are cached once computed: warm with the first prompt
        assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids == refs[composition][0]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs[composition]
    sched = llm.engine.scheduler
    if composition == "preemption":
        assert sched.num_preemptions > 0
    if composition == "prefix_hits":
        assert sched.bm.stats.hits >= 20 * len(prompts)  # 5 full blocks of the shared prefix each
        assert sched.bm.stats.hit_rate > 0.3


def test_second_generate_hits_prefix_cache(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), cpu_kv_cache_bytes=1 << 22, block_size=4)
    prompts = _prompts(5, 3, 30, 40)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(o.num_cached_tokens >= 28 for o in second)
    assert all(o.num_cached_tokens == 0 for o in first)


def test_llama3_rope_scaling_matches_hf(tmp_path) -> None:
    """Llama 3.x's "llama3" rope scaling, with an original context short enough that it matters."""
    from tiny_models import make_tiny_model

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    path = make_tiny_model(tmp_path, "llama", rope_scaling=scaling, rope_theta=10000.0)
    prompts = _prompts(6, 4, 20, 90)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), cpu_kv_cache_bytes=1 << 22)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref


@pytest.mark.parametrize(
    "arch,scaling",
    [
        ("qwen3", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}),
        ("llama", {"rope_type": "linear", "factor": 4.0}),
    ],
)
def test_yarn_and_linear_rope_scaling_match_hf(tmp_path, arch: str, scaling: dict) -> None:
    """Qwen3's YaRN (an original context of 64, so the blend and the attention factor matter by token 100)
    and linear scaling on Llama, over prompts up to 110 tokens."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path, arch, rope_scaling=scaling, rope_theta=10000.0)
    prompts = _prompts(9, 3, 90, 110)
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), cpu_kv_cache_bytes=1 << 22)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref


def test_engine_stats_count_hits_and_preemptions(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), cpu_kv_cache_bytes=1 << 22, block_size=4, num_gpu_blocks_override=12)
    prompts = _prompts(8, 4, 8, 14, shared_prefix=8)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    s = llm.engine.stats()
    assert s["prefix_cache_hits"] >= 8 * 3 and 0 < s["prefix_cache_hit_rate"] < 1
    assert s["preemptions"] > 0 and s["free_blocks"] == s["total_blocks"] == 12


def test_dynamic_ntk_rope_matches_hf_decoding_past_max_position(tmp_path) -> None:
    """Llama with dynamic NTK scaling (factor 2 over 24 positions): prompts within the 24, generation past
    them, where each new position gets the base HF grows for it; the engine serves 48 positions."""
    from tiny_models import make_tiny_model

    scaling = {"rope_type": "dynamic", "factor": 2.0}
    path = make_tiny_model(tmp_path, "llama", max_position_embeddings=24, rope_scaling=scaling)
    prompts, new = _prompts(11, 3, 20, 21), 10  # one length: one HF batch
    ref = hf_greedy_cached(path, prompts, new)
    llm = LLM(str(path), cpu_kv_cache_bytes=1 << 22, max_num_batched_tokens=16, block_size=4)
    assert llm.engine.max_model_len == 48
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids == ref[0]


def test_qwen2_yarn_rope_scaling_matches_hf(tmp_path) -> None:
    """Qwen2 (qkv bias) with YaRN over an original context of 32 and prompts of 36 and 48 tokens, batched
    and chunked (a 32-token budget), then one alone as a prefix hit."""
    from tiny_models import make_tiny_model

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = make_tiny_model(tmp_path, "qwen2", rope_scaling=scaling, rope_theta=10000.0)
    prompts = _prompts(12, 2, 36, 37) + _prompts(14, 2, 48, 49)  # two lengths: two HF batches
    ref = hf_greedy_cached(path, prompts, MAX_NEW)
    llm = LLM(str(path), cpu_kv_cache_bytes=1 << 22, max_num_batched_tokens=32, block_size=4)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    out = llm.generate(prompts[-1:], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == ref[-1] and out.num_cached_tokens >= len(prompts[-1]) - 4
