"""The KV write of the default layout, in plain torch, for backends whose attention library does not write
the cache itself. Per step: rows = valid_rows(meta.slot_mapping) in a builder's build (it syncs once); per
layer: store_kv(kv_cache, k, v, meta.slot_mapping, rows, capturing) before attending."""

from __future__ import annotations

import torch


def valid_rows(slots: torch.Tensor) -> torch.Tensor | None:
    """[n] the rows of slot_mapping with a slot (>= 0), or None when every row has one (syncs once)."""
    valid = slots >= 0
    return None if bool(valid.all()) else valid.nonzero().squeeze(1)


def store_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, -1 writes nowhere
    rows: torch.Tensor | None,  # [n] the rows with slot >= 0, None when all are
    capturing: bool,
) -> None:
    """kv_cache[0] and kv_cache[1] get k and v at every slot >= 0; no other slot changes. capturing: a CUDA
    graph is being captured (torch.cuda.is_current_stream_capturing()); the path taken then reads nothing
    on the host.

    Eagerly, index_copy_ the valid rows. While a graph is captured the valid rows are unknown, so every
    row is written: a -1 row repeats a valid row's write (same slot, same value), or rewrites slot 0 with
    its own value when no row is valid. The captured kernels then serve any later slot_mapping."""
    hkv, d = kv_cache.shape[-2:]
    caches = (kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d))
    if not capturing:
        if rows is not None:
            slots, k, v = slots[rows], k[rows], v[rows]
        for c, x in zip(caches, (k, v)):
            c.index_copy_(0, slots, x)
        return
    # index_select with a [1] index, never t[j] with a 0-dim j: that is .item(), a host sync, which a
    # capture forbids.
    valid = slots >= 0  # [T]
    j = valid.to(torch.int32).argmax().view(1)  # [1]: a valid row if there is one
    has = valid.index_select(0, j)  # [1]
    dst = torch.where(valid, slots, torch.where(has, slots.index_select(0, j), 0))  # [T]
    for c, x in zip(caches, (k, v)):
        fill = torch.where(has[:, None, None], x.index_select(0, j), c[:1])  # [1, Hkv, D]
        c.index_copy_(0, dst, torch.where(valid[:, None, None], x, fill))
