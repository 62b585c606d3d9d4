"""KV-cache sizing of one rank: what a block costs in the backend's layout, and the per-layer tensors."""

from __future__ import annotations

import math
import mmap

import torch

from turnout.attention.backend import AttentionBackend, AttentionSpec


def _layer_shape(backend: AttentionBackend, spec: AttentionSpec, num_blocks: int) -> tuple:
    return backend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)


def kv_bytes_per_block(backend: AttentionBackend, spec: AttentionSpec) -> int:
    """Bytes one block takes over every attention layer of this rank, in the cache's dtype."""
    return spec.num_layers * math.prod(_layer_shape(backend, spec, 1)) * spec.cache_dtype.itemsize


def blocks_in(budget_bytes: float, backend: AttentionBackend, spec: AttentionSpec) -> int:
    """How many whole blocks fit in budget_bytes (0 when none do)."""
    return max(0, int(budget_bytes // kv_bytes_per_block(backend, spec)))


def allocate_kv_caches(
    backend: AttentionBackend, spec: AttentionSpec, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed tensor of spec.cache_dtype per attention layer: kv_caches[i] belongs to the layer with
    layer_idx i."""
    shape = _layer_shape(backend, spec, num_blocks)
    zeros = _lazy_zeros if device.type == "cpu" else torch.zeros
    return [zeros(shape, dtype=spec.cache_dtype, device=device) for _ in range(spec.num_layers)]


def _lazy_zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros on the CPU from a private anonymous mapping, which the kernel hands out zeroed and
    page-aligned: a page is faulted in when a block first writes it, not all at start-up (memset over a
    fresh GiB costs 0.2-0.7 s of page faults). The tensor holds the mapping; freeing it unmaps."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
