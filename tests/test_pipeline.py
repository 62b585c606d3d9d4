"""Pipeline parallelism over worker processes (gloo on the CPU): PP=2 and TP=2 x PP=2 against uniproc and HF,
with chunked prefill and several requests per step, so each step runs as several micro-batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnout import LLM, SamplingParams
from turnout.engine.scheduler import ScheduledRequest
from turnout.errors import ConfigError
from turnout.worker.model_runner import micro_batches

from tiny_models import hf_greedy, make_tiny_model

pytest.importorskip("turnout_multiproc")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(20, 57)), [300], list(range(400, 419)), list(range(100, 130))]
KW = {"cpu_kv_cache_bytes": 1 << 22, "block_size": 8, "max_num_batched_tokens": 16, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: Path) -> dict[str, Path]:
    """Llama with 3 layers (stages of 2 + 1, 2 KV heads) and the 2-layer Qwen3 (1 KV head)."""
    llama = make_tiny_model(tmp_path_factory.mktemp("llama3l"), "llama", num_kv_heads=2, num_hidden_layers=3)
    return {"llama": llama, "qwen3": tiny_qwen3}


def _tokens(path: Path, **kw) -> list[list[int]]:
    llm = LLM(str(path), **KW, **kw)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def uniproc_refs(models: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {name: _tokens(path) for name, path in models.items()}


def _req(n: int) -> ScheduledRequest:
    return ScheduledRequest(f"r{n}", [0] * n, 0, [], True, GREEDY, [], [])


def test_micro_batches_split_by_tokens() -> None:
    def lens(sizes: list[int], n: int) -> list[list[int]]:
        return [[len(r.token_ids) for r in mb] for mb in micro_batches([_req(s) for s in sizes], n)]

    assert lens([100, 1, 1, 1], 2) == [[100], [1, 1, 1]]  # a long prefill chunk beside decodes
    assert lens([1] * 4, 2) == [[1, 1], [1, 1]]
    assert lens([8, 1, 8, 1, 1], 3) == [[8], [1, 8], [1, 1]]
    assert lens([5], 2) == [[5]]  # fewer requests than stages: fewer micro-batches
    assert lens([1, 1], 4) == [[1], [1]]


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_pp2_matches_uniproc(models: dict[str, Path], uniproc_refs: dict, model: str) -> None:
    assert _tokens(models[model], pipeline_parallel_size=2) == uniproc_refs[model]


@pytest.mark.slow  # 4 processes on 2 cores: 12 s alone, up to 23 s on a busy machine
@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_tp2_pp2_matches_uniproc(models: dict[str, Path], uniproc_refs: dict, model: str) -> None:
    assert _tokens(models[model], tensor_parallel_size=2, pipeline_parallel_size=2) == uniproc_refs[model]


def test_uniproc_matches_hf(models: dict[str, Path], uniproc_refs: dict) -> None:
    """Ties the PP runs above to the oracle: the 3-layer Llama (uneven stages) against HF."""
    assert uniproc_refs["llama"][:3] == hf_greedy(models["llama"], PROMPTS[:3], GREEDY.max_tokens)


def test_more_stages_than_layers_is_refused(tiny_qwen3: Path) -> None:
    with pytest.raises(ConfigError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM(str(tiny_qwen3), pipeline_parallel_size=3, **KW)
