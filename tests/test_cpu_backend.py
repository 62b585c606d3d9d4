"""The CPU backend's prefill: torch's flash kernel, and the same bits with and without a prefix hit (the
conformance suite checks the values against float64)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from turnout_cpu.backend import BALANCE_MIN_LEN, CPUAttentionBackend

from turnout.attention import AttentionImpl, AttentionMetadata, AttentionMetadataBuilder, AttentionSpec
from turnout.worker.kv_cache import allocate_kv_caches, blocks_in, kv_bytes_per_block

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16  # the embedded SmolLM2's attention


def _backend(dtype: torch.dtype) -> tuple[AttentionMetadataBuilder, AttentionImpl]:
    """The CPU backend's builder and layer 0's impl, over the embedded SmolLM2's attention in dtype."""
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, dtype, BLOCK, HEAD_SIZE**-0.5, num_layers=1)
    be = CPUAttentionBackend()
    return be.make_builder(spec, 0), be.make_impl(spec, spec.layer(0))


def _cache(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((2, -(-tokens // BLOCK), BLOCK, KV_HEADS, HEAD_SIZE), float("nan"), dtype=dtype)


def _chunk(be, cache, q, k, v, ctx: int) -> torch.Tensor:
    """Tokens [ctx, ctx + len(q)) of one request whose first ctx tokens are cached; blocks in order."""
    n, seq = q.shape[0], ctx + q.shape[0]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(ctx, seq),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([seq], dtype=torch.int32),
        block_table=torch.arange(cache.shape[1], dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=seq,
        num_actual_tokens=n,
    )
    builder, impl = be
    meta.backend_data = builder.build(meta)
    return impl.forward(q, k, v, cache, meta)


def _qkv(tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, h, HEAD_SIZE, generator=gen).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_prefix_hit_changes_no_bit(dtype: torch.dtype) -> None:
    """A chunk after cached context has the bits of one pass over the prompt up to the chunk's end, so a
    request that finds its prefix cached computes what it would have without (the server's tests compare
    such requests with LLM.generate token for token)."""
    tokens = 1100
    q, k, v = _qkv(tokens, dtype)
    be, cache = _backend(dtype), _cache(tokens, dtype)
    whole = _chunk(be, cache, q, k, v, 0)
    for hit in (16, 500, 512, 600, 1088):  # a block; 12 rows to a 512-key tile; a tile; past it; the last 12
        assert torch.equal(_chunk(be, cache, q[hit:], k[hit:], v[hit:], hit), whole[hit:]), hit


def test_a_long_prompt_has_the_bits_of_one_pass() -> None:
    """From BALANCE_MIN_LEN tokens a fresh prompt's heads split over the kernel's threads (an odd head in
    row slices): the bits of one is_causal pass, and a prefix hit still changes none."""
    tokens = BALANCE_MIN_LEN + 100
    q, k, v = _qkv(tokens, torch.bfloat16)
    be, cache = _backend(torch.bfloat16), _cache(tokens, torch.bfloat16)
    whole = _chunk(be, cache, q, k, v, 0)
    heads = [t.transpose(0, 1)[None] for t in (q, k, v)]
    one = F.scaled_dot_product_attention(*heads, is_causal=True, scale=HEAD_SIZE**-0.5, enable_gqa=True)
    assert torch.equal(whole, one[0].transpose(0, 1))
    assert torch.equal(_chunk(be, cache, q[600:], k[600:], v[600:], 600), whole[600:])


def test_prefill_runs_the_flash_kernel() -> None:
    q, k, v = _qkv(96, torch.bfloat16)
    be, cache = _backend(torch.bfloat16), _cache(96, torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _chunk(be, cache, q[:64], k[:64], v[:64], 0)
        _chunk(be, cache, q[64:], k[64:], v[64:], 64)
    calls = [e.key for e in prof.key_averages() if "scaled_dot_product" in e.key]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in calls
    assert not [c for c in calls if "math" in c], calls  # 3-D inputs take the math kernel, ~5x slower at 2k


def _rss_bytes() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) << 10


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_a_cpu_kv_cache_is_zero_and_costs_no_memory_until_written() -> None:
    """The default 1 GiB CPU cache: zeroed, yet its pages are taken only as blocks are written, so an
    engine starts without a memset over all of it."""
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, torch.bfloat16, BLOCK, HEAD_SIZE**-0.5, num_layers=30)
    be = CPUAttentionBackend()
    before = _rss_bytes()
    caches = allocate_kv_caches(be, spec, blocks_in(1 << 30, spec), torch.device("cpu"))
    assert _rss_bytes() - before < 64 << 20  # a memset would have taken the whole GiB
    assert sum(c.nbytes for c in caches) > (1 << 30) - kv_bytes_per_block(spec)
    caches[3][1, 7] = 1.0
    assert all(c.is_contiguous() and c.dtype == torch.bfloat16 for c in caches)
    assert caches[3][1, 7].all() and caches[3].sum() == caches[3][1, 7].numel() and not caches[4].any()
