"""A float64 paged-attention reference and random paged layouts for the attention conformance suite.

Independent of every backend: keys are gathered from the cache through block_table in plain torch. An FP8
cache (float8_e4m3fn) is written here by vLLM's formula, e4m3(clamp(x / scale, -448, 448)), and read by
the reference as stored * scale in float64.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from turnout.attention import AttentionMetadata

KINDS = ("decode", "prefill", "prefix", "chunked")
FP8 = torch.float8_e4m3fn


def fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 KV cache stores it: e4m3(clamp(x / scale, -448, 448)), computed in float32."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def ref_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], after this step's write
    meta: AttentionMetadata,
    scale: float,
    num_kv_heads: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention in float64 -> [num_actual_tokens, H, D]; a query at position p sees the keys
    (p - sliding_window, p] under a window, and scores s become cap * tanh(s / cap) under a soft-cap. An
    FP8 cache's keys and values are read as stored * k_scale and stored * v_scale."""
    h, d = q.shape[1:]
    bs = kv_cache.shape[2]
    cu, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    out = torch.zeros(meta.num_actual_tokens, h, d, dtype=torch.float64, device=q.device)
    for b, seq_len in enumerate(seq_lens):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        blocks = meta.block_table[b, : -(-seq_len // bs)].long()
        kv = kv_cache[:, blocks].reshape(2, -1, num_kv_heads, d)[:, :seq_len].double()  # [2, S, KVH, D]
        if kv_cache.dtype == FP8:
            kv = torch.stack([kv[0] * k_scale, kv[1] * v_scale])
        kv = kv.repeat_interleave(h // num_kv_heads, dim=2)  # [2, S, H, D]
        qb = q[q0:q1].double()  # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", qb, kv[0]) * scale  # [H, L, S]
        if logits_soft_cap is not None:
            s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
        qpos = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)[:, None]
        kpos = torch.arange(seq_len, device=q.device)[None, :]
        seen = kpos <= qpos  # [L, S]
        if sliding_window is not None:
            seen &= kpos > qpos - sliding_window
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, kv[1])
    return out


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D], T = num_actual_tokens + padding
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # NaN everywhere except the context cached before this step
    meta: AttentionMetadata
    scale: float
    num_kv_heads: int
    expected_cache: torch.Tensor  # kv_cache after a correct write of k, v at slot_mapping
    expected: torch.Tensor  # float64 [num_actual_tokens, H, D]
    kinds: list[str]


def _draw_request(rng: random.Random, kind: str, block_size: int, max_ctx: int, max_query: int):
    """(context already cached, query_len) for one request of `kind`."""
    if kind == "decode":
        return rng.randint(1, max_ctx), 1
    if kind == "prefill":
        return 0, rng.randint(2, max_query)
    if kind == "prefix":  # a prefix-cache hit covers whole blocks
        return block_size * rng.randint(1, max(1, max_ctx // block_size)), rng.randint(2, max_query)
    if kind == "chunked":  # earlier chunks of this prompt, at any offset; more of it follows
        return rng.randint(1, max_ctx), rng.randint(2, max_query)
    raise ValueError(kind)


def make_case(
    rng: random.Random,
    num_reqs: int,
    gqa: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    kinds: tuple[str, ...] = KINDS,
    *,
    num_kv_heads: int = 2,
    max_ctx: int = 64,
    max_query: int = 24,
    pad_tokens: int = 0,
    decode_first: bool = True,
    device: str | torch.device = "cpu",
    fp8_scales: tuple[float, float] | None = None,
) -> Case:
    """A random step: each request's kind is drawn from `kinds`; blocks are shuffled (block 0 never used,
    so padded block_table entries point at poison); the last block of each request is usually partial;
    `pad_tokens` graph-padding tokens with slot -1 follow the real ones. fp8_scales (k_scale, v_scale): the
    cache is float8_e4m3fn, its context and this step's k, v quantized with them (poison stays NaN), and
    the reference reads it dequantized."""
    reqs = [
        (kind, *_draw_request(rng, kind, block_size, max_ctx, max_query))
        for kind in rng.choices(kinds, k=num_reqs)
    ]
    if decode_first:
        reqs.sort(key=lambda r: r[2] != 1)
    qlens = [ql for _, _, ql in reqs]
    seq_lens = [ctx + ql for _, ctx, ql in reqs]
    nblocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblocks) + 1 + rng.randint(1, 4)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    table = torch.zeros(num_reqs, max(nblocks) + rng.randint(0, 2), dtype=torch.int32)
    for b, n in enumerate(nblocks):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]

    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    h, t_act = num_kv_heads * gqa, sum(qlens)
    t = t_act + pad_tokens
    q, k, v = (torch.randn(t, n, head_size, generator=gen).to(dtype) for n in (h, num_kv_heads, num_kv_heads))
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    flat = cache.view(2, -1, num_kv_heads, head_size)
    slots = torch.full((t,), -1, dtype=torch.int64)
    tok = 0
    for b, (_, ctx, ql) in enumerate(reqs):
        pos = torch.arange(ctx + ql)
        pslots = table[b, pos // block_size].long() * block_size + pos % block_size
        flat[:, pslots[:ctx]] = torch.randn(2, ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        slots[tok : tok + ql] = pslots[ctx:]
        tok += ql
    new = torch.stack([k[:t_act], v[:t_act]])
    if fp8_scales is not None:
        cache = torch.stack([fp8_quantize(cache[i], fp8_scales[i]) for i in (0, 1)])
        new = torch.stack([fp8_quantize(new[i], fp8_scales[i]) for i in (0, 1)])
    expected_cache = cache.clone()
    expected_cache.view(2, -1, num_kv_heads, head_size)[:, slots[:t_act]] = new

    num_decode = next((i for i, ql in enumerate(qlens) if ql != 1), num_reqs)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        num_actual_tokens=t_act,
        num_decode_tokens=num_decode,
    )
    scale = head_size**-0.5
    k_scale, v_scale = fp8_scales or (1.0, 1.0)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    expected = ref_paged_attention(q, expected_cache, meta, scale, num_kv_heads, **scales)
    dev = torch.device(device)
    for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_table"):
        setattr(meta, f, getattr(meta, f).to(dev))
    q, k, v, cache, expected_cache = (x.to(dev) for x in (q, k, v, cache, expected_cache))
    kinds_out = [kind for kind, _, _ in reqs]
    return Case(q, k, v, cache, meta, scale, num_kv_heads, expected_cache, expected.to(dev), kinds_out)
