"""On a CUDA machine only: every graph mode gives NONE's greedy tokens, and every GPU attention backend
(and pairs of them per phase: decode+mixed) agrees with HF transformers (bf16, same GPU) step by step on
the same history."""

from __future__ import annotations

import random

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.errors import SelectionError

from tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
GPU_BACKENDS = [
    "triton",
    "flashinfer",
    "flash_attn",
    "triton+flashinfer",
    "triton+flash_attn",
    "flashinfer+triton",
]


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory):
    """A 4-layer Qwen3 with real head sizes (128); both engines run it in bf16."""
    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
    root = tmp_path_factory.mktemp("qwen3_gpu")
    return make_tiny_model(root, "qwen3", num_kv_heads=2, head_dim=128, max_position_embeddings=4096, **shape)


def _prompts(n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(path, backend: str, mode: str) -> LLM:
    try:
        return LLM(str(path), attention_backend=backend, cudagraph_mode=mode, dtype="bfloat16",
                   max_num_batched_tokens=256, gpu_memory_utilization=0.3)  # fmt: skip
    except SelectionError as e:  # a backend that is not installed here; any other error fails
        pytest.skip(f"{backend}: {str(e).splitlines()[0]}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_modes_match_none(small_qwen3, backend):
    prompts = _prompts(24, 8, 300)  # mixed, chunked by the 256-token budget
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for mode in MODES:
        llm = _engine(small_qwen3, backend, mode)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    for mode in MODES[1:]:
        assert outs[mode] == outs["NONE"], mode


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backend_agrees_with_hf_step_by_step(small_qwen3, backend):
    from transformers import AutoModelForCausalLM

    prompts = _prompts(8, 16, 200)
    hf = AutoModelForCausalLM.from_pretrained(small_qwen3, dtype=torch.bfloat16).cuda().eval()
    forced, want = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)[0]
            cont = gen[len(p) :].tolist()
            forced += [p + cont[:i] for i in range(len(cont))]
            want += cont
    llm = _engine(small_qwen3, backend, "NONE")
    got = [
        o.token_ids[0]
        for o in llm.generate(forced, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ]
    rate = sum(a == b for a, b in zip(got, want)) / len(want)
    assert rate >= 0.95, rate


def test_kv_cache_size_does_not_shrink_with_max_num_seqs(small_qwen3):
    """The memory-profiling step runs max_num_seqs requests over a throwaway KV cache of a block each; that
    cache gives way to the real one, so it must not count as activation memory (at the Qwen3-8B shape and
    128-token blocks it was 9 GiB at 512 requests)."""
    blocks = {}
    for seqs in (8, 256):
        llm = LLM(str(small_qwen3), dtype="bfloat16", block_size=128, max_num_seqs=seqs, enforce_eager=True,
                  gpu_memory_utilization=0.3)  # fmt: skip
        blocks[seqs] = llm.engine.scheduler.bm.num_blocks
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert abs(blocks[256] - blocks[8]) <= 32, blocks  # 248 blocks (124 MiB) apart when it counted
