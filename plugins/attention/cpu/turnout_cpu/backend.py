"""Paged attention with torch's SDPA on the CPU.

Decode rows (one query token) run batched: their block_table rows are gathered into one padded
[Bd, Hkv, L, D] tensor with a length mask. Prefill rows (chunks, prefix hits) run one request at a
time, as [1, H, q_len, D] so that SDPA takes its flash kernel (3-D inputs get the math one, ~5x slower at
2k tokens). A fresh prompt attends over its own keys with is_causal; a chunk after cached context (a prefix
hit, an earlier chunk) over the cache with a causal mask offset by that context, in slices of rows whose
keys end on the kernel's key tiles. That gives the bits of a fresh prompt ending where the chunk ends, so a
prefix hit changes no output. The same slicing balances a fresh prompt's heads over the kernel's threads
(see _causal). All indices and masks are built once per step by CPUMetadataBuilder, from the metadata and
the spec; CPUAttentionImpl runs one layer on them.

A layer with a sliding window or a logit soft-cap runs explicit matmuls instead (SDPA cannot cap scores):
decode rows batched as above, with the window narrowing the length mask; prefill rows in slices of
ROW_SLICE queries, each against only the keys its window reaches.

An FP8 cache (kv_cache_dtype fp8) is written quantized with the layer's k_scale / v_scale and read back
dequantized into the activations' dtype (turnout.attention.quantize_kv / dequantize_kv) wherever keys and
values are gathered; a fresh prompt attends over its own k, v as the cache holds them.

Multi-head latent attention (the "mla" spec, spec.kv_lora_rank set) runs the same paths over one page
tensor [num_blocks, block_size, 1, D] of latent vectors: one gather gives the keys, and their first
kv_lora_rank dims are the values (SDPA takes a value head size other than the key's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from turnout import Priority
from turnout.attention import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CudagraphSupport,
    dequantize_kv,
    quantize_kv,
    valid_rows,
)

KEY_TILE = 512  # keys a tile of torch's CPU flash kernel (kv_split_size in aten's FlashAttentionKernel.cpp)
# Below this many queries the kernel takes another path, whose bits differ from a longer call's on
# AVX-512 machines (measured with torch 2.13): _tiled pads shorter slices up to it
MIN_QUERIES = 64
BALANCE_MIN_LEN = 4096  # fresh prompts from here get _causal's balanced heads (measured: slower at 2k)
ROW_SLICE = 512  # queries per explicit-matmul slice: [H, 512, keys] float32 scores at a time


@dataclass
class _Prefill:
    q_start: int
    q_end: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] the block ids of the request's keys
    seq_len: int
    # the causal mask of the last min(KEY_TILE, seq_len) positions over every key, 0 or -inf, for the row
    # slices (_tiled); None where the chunk runs in one is_causal pass
    mask: torch.Tensor | None
    causal_heads: int  # a fresh prompt's heads that run in is_causal calls (_split_heads); the rest, _tiled


@dataclass
class CPUMetadata:
    decode_tokens: torch.Tensor  # [Bd] token index of each decode row's query
    decode_blocks: torch.Tensor  # [Bd, max_blocks] block ids
    decode_lens: torch.Tensor  # [Bd] seq_len of each decode row
    prefills: list[_Prefill]
    store_rows: torch.Tensor | None  # [n] rows with a slot when some slots are -1 (padding), else None
    decode_slots: torch.Tensor  # [Bd * L] cache slot of every key position, L = longest decode row
    decode_mask: torch.Tensor  # [Bd, 1, 1, L] True = attend
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding_window -> decode_mask in it

    def window_mask(self, window: int | None) -> torch.Tensor:
        """decode_mask narrowed to each row's latest `window` keys (made once a step per window)."""
        if window is None:
            return self.decode_mask
        if window not in self.windowed:
            pos = torch.arange(self.decode_mask.shape[-1])
            recent = pos[None, :] >= (self.decode_lens - window)[:, None]  # [Bd, L]
            self.windowed[window] = self.decode_mask & recent[:, None, None, :]
        return self.windowed[window]


class CPUMetadataBuilder(AttentionMetadataBuilder):
    """One KV-cache group's CPUMetadata a step."""

    def build(self, meta: AttentionMetadata) -> CPUMetadata:
        """The step's decode rows, gathered, and its prefill rows, one by one (module docstring)."""
        qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        decode_rows, prefills = [], []
        for row, (qs, qe, seq_len) in enumerate(zip(qsl, qsl[1:], seq_lens)):
            if qe - qs == 1:
                decode_rows.append(row)
                continue
            heads = _split_heads(self.spec.num_heads, qe - qs)
            sliced = seq_len > qe - qs or heads < self.spec.num_heads
            mask = _causal_mask(max(0, seq_len - KEY_TILE), seq_len, self.spec.dtype) if sliced else None
            blocks = meta.block_table[row, : -(-seq_len // self.spec.block_size)].long()
            prefills.append(_Prefill(qs, qe, blocks, seq_len, mask, heads))
        rows = torch.tensor(decode_rows, dtype=torch.long)
        blocks, lens = meta.block_table[rows].long(), meta.seq_lens[rows].long()
        return CPUMetadata(
            decode_tokens=meta.query_start_loc[rows].long(),
            decode_blocks=blocks,
            decode_lens=lens,
            prefills=prefills,
            store_rows=valid_rows(meta.slot_mapping[: meta.num_actual_tokens]),
            **_decode_slots(blocks, lens, self.spec.block_size),
        )


class CPUAttentionImpl(AttentionImpl):
    """One layer's attention over the step's CPUMetadata."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        md: CPUMetadata = meta.backend_data
        layer = self.layer
        plain = layer.sliding_window is None and layer.logits_soft_cap is None
        self._store(kv_cache, k, v, meta, md, layer)
        out = q.new_zeros(*q.shape[:2], v.shape[-1])
        pages, latent = _pages(kv_cache, self.spec.kv_lora_rank), self.spec.kv_lora_rank
        if len(md.decode_tokens):
            dq = q.index_select(0, md.decode_tokens)
            keys, vals = _decode_kv(pages, latent, md, layer, q.dtype)
            if plain:
                o = _decode(dq, keys, vals, md, layer)
            else:
                o = _decode_features(dq, keys, vals, md, layer)
            out.index_copy_(0, md.decode_tokens, o)
        if md.prefills and kv_cache.dtype != k.dtype:  # fresh prompts attend over k, v as cached
            k, v = _as_cached(k, layer.k_scale, kv_cache.dtype), _as_cached(v, layer.v_scale, kv_cache.dtype)
        for p in md.prefills:
            if plain:
                _prefill(q, k, v, pages, latent, p, layer, out)
            else:
                _prefill_features(q, pages, latent, p, layer, out)
        return out

    def _store(
        self,
        kv_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        md: CPUMetadata,
        layer: AttentionLayerSpec,
    ) -> None:
        t = meta.num_actual_tokens
        slots, k, v = meta.slot_mapping[:t], k[:t], v[:t]
        if md.store_rows is not None:
            slots, k, v = slots[md.store_rows], k[md.store_rows], v[md.store_rows]
        if (cache_dtype := kv_cache.dtype) != k.dtype:
            k, v = quantize_kv(k, layer.k_scale, cache_dtype), quantize_kv(v, layer.v_scale, cache_dtype)
        for page, x in zip(_pages(kv_cache, self.spec.kv_lora_rank), (k, v)):  # MLA: k alone
            _bytes(page).view(-1, *page.shape[-2:]).index_copy_(0, slots, _bytes(x))


class CPUAttentionBackend(AttentionBackend):
    """Paged attention with torch's SDPA and matmuls on the CPU (module docstring)."""

    name = "cpu"
    priority = Priority.DEFAULT
    device_types = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    cudagraph_support = CudagraphSupport.NEVER
    attention_features = frozenset(LAYER_FEATURES)
    kv_cache_dtypes = ("auto", "fp8")
    kv_cache_specs = ("full", "sliding_window", "mla")  # a window reads only its blocks: nulled ones never
    builder_cls = CPUMetadataBuilder
    impl_cls = CPUAttentionImpl


def _decode(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, md: CPUMetadata, layer: AttentionLayerSpec
) -> torch.Tensor:
    """q [Bd, H, D] over _decode_kv's keys [Bd, Hkv, L, D] and vals [Bd, Hkv, L, Dv] -> [Bd, H, Dv]."""
    (bd, h, d), hkv, scale = q.shape, keys.shape[1], layer.scale
    if q.dtype == torch.float32:
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, vals, attn_mask=md.decode_mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)
    # torch's CPU SDPA is ~3x slower than plain matmuls at these sizes in bf16/fp16
    qg = q.view(bd, hkv, -1, d)  # [Bd, Hkv, G, D]: the G query heads sharing one KV head
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [Bd, Hkv, G, L]
    scores.masked_fill_(~md.decode_mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(q.dtype), vals).view(bd, h, -1)


def _decode_features(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, md: CPUMetadata, layer: AttentionLayerSpec
) -> torch.Tensor:
    """_decode under the layer's window and soft-cap."""
    (bd, h, d), hkv = q.shape, keys.shape[1]
    qg = q.view(bd, hkv, -1, 1, d)  # [Bd, Hkv, G, 1, D]
    mask = md.window_mask(layer.sliding_window)[..., None, :]  # [Bd, 1, 1, 1, L]
    return _explicit(qg, keys, vals, mask, layer).view(bd, h, -1)


def _pages(kv_cache: torch.Tensor, kv_lora_rank: int | None) -> list[torch.Tensor]:
    """The cache's page tensors, [num_blocks, block_size, Hkv, D] each: keys and values, or under MLA
    (kv_lora_rank) the latent vectors alone."""
    return [kv_cache] if kv_lora_rank else [kv_cache[0], kv_cache[1]]


def _keys_values(xs: list[torch.Tensor], kv_lora_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of what was gathered from _pages: under MLA the values are the keys' first
    kv_lora_rank dims."""
    return (xs[0], xs[0][..., :kv_lora_rank]) if kv_lora_rank else (xs[0], xs[1])


def _decode_kv(
    pages: list[torch.Tensor],
    kv_lora_rank: int | None,
    md: CPUMetadata,
    layer: AttentionLayerSpec,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decode row's cached keys and values in dtype, [Bd, Hkv, L, D] and [Bd, Hkv, L, Dv] (L = the
    longest row)."""
    bd = md.decode_blocks.shape[0]
    xs = [
        _bytes(c)
        .view(-1, *c.shape[-2:])
        .index_select(0, md.decode_slots)
        .view(c.dtype)
        .view(bd, -1, *c.shape[-2:])
        for c in pages
    ]
    k, v = _keys_values(xs, kv_lora_rank)
    k, v = dequantize_kv(k, layer.k_scale, dtype), dequantize_kv(v, layer.v_scale, dtype)
    return k.transpose(1, 2), v.transpose(1, 2)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """x, or an FP8 x's bytes as uint8: torch's CPU index_select and index_copy_ take no float8."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _as_cached(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype gives it back: quantized with scale, then dequantized into x's dtype."""
    return dequantize_kv(quantize_kv(x, scale, cache_dtype), scale, x.dtype)


def _cached_kv(
    pages: list[torch.Tensor],
    kv_lora_rank: int | None,
    p: _Prefill,
    layer: AttentionLayerSpec,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's cached keys and values in dtype, [seq_len, Hkv, D] and [seq_len, Hkv, Dv]."""
    # index_select, not kv_cache[0, blocks]: advanced indexing is orders of magnitude slower on CPU
    xs = [
        _bytes(c).index_select(0, p.blocks).view(c.dtype).view(-1, *c.shape[-2:])[: p.seq_len] for c in pages
    ]
    keys, vals = _keys_values(xs, kv_lora_rank)
    return dequantize_kv(keys, layer.k_scale, dtype), dequantize_kv(vals, layer.v_scale, dtype)


def _explicit(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, layer: AttentionLayerSpec
) -> torch.Tensor:
    """softmax(cap(q k^T * scale), masked) v in float32, as HF's eager attention computes it: q [N, Hkv, G,
    L, D], keys [N, Hkv, S, D] and vals [N, Hkv, S, Dv], mask broadcast to [N, Hkv, G, L, S] (True =
    attend) -> [N, Hkv, G, L, Dv]. Masked keys must be finite."""
    scores = torch.matmul(q.float(), keys.unsqueeze(2).transpose(-1, -2).float()) * layer.scale
    if (cap := layer.logits_soft_cap) is not None:
        scores = torch.tanh(scores / cap) * cap
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1)
    return torch.matmul(probs, vals.unsqueeze(2).float()).to(q.dtype)


def _prefill_features(
    q: torch.Tensor,
    pages: list[torch.Tensor],
    kv_lora_rank: int | None,
    p: _Prefill,
    layer: AttentionLayerSpec,
    out: torch.Tensor,
) -> None:
    """One request's chunk of queries into out[q_start:q_end] under the layer's window and soft-cap, in
    slices of ROW_SLICE queries, each against the cached keys its window reaches (this chunk's included)."""
    hkv, d = pages[0].shape[-2:]
    keys, vals = _cached_kv(pages, kv_lora_rank, p, layer, q.dtype)
    ctx, window = p.seq_len - (p.q_end - p.q_start), layer.sliding_window
    for start in range(p.q_start, p.q_end, ROW_SLICE):
        end = min(start + ROW_SLICE, p.q_end)
        first, last = ctx + start - p.q_start, ctx + end - p.q_start  # positions [first, last)
        lo = 0 if window is None else max(0, first - window + 1)
        qpos, kpos = torch.arange(first, last)[:, None], torch.arange(lo, last)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        qg = q[start:end].transpose(0, 1).reshape(hkv, -1, end - start, d)[None]  # [1, Hkv, G, n, D]
        kk, vv = (t[lo:last].transpose(0, 1)[None] for t in (keys, vals))  # [1, Hkv, S, D]
        o = _explicit(qg, kk, vv, mask, layer)  # [1, Hkv, G, n, Dv]
        out[start:end] = o.reshape(-1, end - start, o.shape[-1]).transpose(0, 1)


def _decode_slots(blocks: torch.Tensor, lens: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """The cache slot of every key position of every decode row, [Bd * L], and the [Bd, 1, 1, L] mask of
    the real ones. Positions past a row's seq_len point at its position 0: a finite value that the mask
    then ignores (a masked slot still meets the values in the matmul, so it must not hold NaN)."""
    pos = torch.arange(int(lens.max()) if len(lens) else 0)
    valid = pos[None, :] < lens[:, None]  # [Bd, L]
    pos = torch.where(valid, pos, 0)
    slots = blocks.gather(1, pos // block_size) * block_size + pos % block_size
    return {"decode_slots": slots.flatten(), "decode_mask": valid[:, None, None, :]}


def _causal_mask(first: int, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[seq_len - first, seq_len] 0 or -inf: query positions [first, seq_len) over keys [0, seq_len).
    Additive, in the activations' dtype: SDPA would convert a bool mask in every layer."""
    later = torch.arange(seq_len)[None, :] > torch.arange(first, seq_len)[:, None]
    return torch.zeros(later.shape, dtype=dtype).masked_fill_(later, float("-inf"))


def _split_heads(num_heads: int, q_len: int) -> int:
    """How many of a fresh prompt's heads _causal runs in is_causal calls: a multiple of the threads."""
    threads = torch.get_num_threads()
    if q_len < BALANCE_MIN_LEN or num_heads < threads:
        return num_heads
    return num_heads - num_heads % threads


def _head_runs(lo: int, hi: int, group: int) -> list[tuple[int, int]]:
    """Query heads [lo, hi) as runs that each take a slice of the KV heads (no copy for enable_gqa): whole
    groups, and the heads of one group at either end."""
    cuts = sorted({lo, hi, *(g for g in (-(-lo // group) * group, hi // group * group) if lo < g < hi)})
    return list(zip(cuts, cuts[1:]))


def _causal(
    sdpa, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None, even: int
) -> torch.Tensor:
    """A fresh prompt's attention: q [1, H, n, D] over its keys [1, Hkv, n, D], vals [1, Hkv, n, Dv] ->
    [1, H, n, Dv].

    The flash kernel hands each thread an equal run of (head, query block) items, and a causal block costs
    as many key tiles as it reaches; a run that ends inside a head leaves that head's costly blocks to one
    thread. So from BALANCE_MIN_LEN queries, `even` heads (a multiple of the threads' count, _split_heads)
    go in is_causal calls, and the other heads in _tiled's row slices over mask, whose blocks cost alike:
    the bits of one pass."""
    h, group = q.shape[1], q.shape[1] // keys.shape[1]
    if even == h:
        return sdpa(q, keys, vals, is_causal=True)
    out = q.new_empty(*q.shape[:3], vals.shape[-1])
    for lo, hi in _head_runs(0, even, group) + _head_runs(even, h, group):
        kv = slice(lo // group, (hi - 1) // group + 1)
        qq, kk, vv = q[:, lo:hi], keys[:, kv], vals[:, kv]
        out[:, lo:hi] = sdpa(qq, kk, vv, is_causal=True) if hi <= even else _tiled(sdpa, qq, kk, vv, mask)
    return out


def _tiled(sdpa, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [1, h, n, D], the last n of keys' L positions, in slices of rows whose keys end
    on an edge of the kernel's key tiles: as with is_causal, no tile that is all masked for a slice is
    computed, and the bits stay those of one pass (such a tile adds nothing). mask: _Prefill.mask, the
    last rows of the causal mask over L keys; a slice's rows [end - m, end) over keys [0, end) are its last
    m rows and last `end` columns (the mask depends on key - position alone). A slice of fewer queries than
    one pass over the prompt would make (MIN_QUERIES, or seq_len below it) runs with copies of its first row
    in front, so that it takes that pass's path through the kernel."""
    n, seq_len, rows = q.shape[2], keys.shape[2], mask.shape[0]
    ctx, start, least = seq_len - n, 0, min(MIN_QUERIES, seq_len)
    out = q.new_empty(*q.shape[:3], vals.shape[-1])
    for end in [*range(ctx // KEY_TILE * KEY_TILE + KEY_TILE, seq_len, KEY_TILE), seq_len]:
        m = end - ctx - start
        qs, tile = q[:, :, start : start + m], mask[rows - m :, seq_len - end :]
        if m < least:
            qs = torch.cat([qs[:, :, :1].expand(-1, -1, least - m, -1), qs], 2)
            tile = torch.cat([tile[:1].expand(least - m, -1), tile])
        out[:, :, start : start + m] = sdpa(qs, keys[:, :, :end], vals[:, :, :end], attn_mask=tile)[:, :, -m:]
        start += m
    return out


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: list[torch.Tensor],
    kv_lora_rank: int | None,
    p: _Prefill,
    layer: AttentionLayerSpec,
    out: torch.Tensor,
) -> None:
    """One request's chunk of queries into out[q_start:q_end]; k, v as the cache holds them."""
    sdpa = functools.partial(F.scaled_dot_product_attention, scale=layer.scale, enable_gqa=True)
    qq = q[p.q_start : p.q_end].transpose(0, 1)[None]  # [1, H, q_len, D]
    if p.seq_len == p.q_end - p.q_start:  # a fresh prompt: its keys are this chunk's
        keys, vals = (t[p.q_start : p.q_end].transpose(0, 1)[None] for t in (k, v))
        out[p.q_start : p.q_end] = _causal(sdpa, qq, keys, vals, p.mask, p.causal_heads)[0].transpose(0, 1)
        return
    keys, vals = _cached_kv(pages, kv_lora_rank, p, layer, q.dtype)
    keys, vals = keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]
    out[p.q_start : p.q_end] = _tiled(sdpa, qq, keys, vals, p.mask)[0].transpose(0, 1)
