"""KV-cache sizing of one rank: what a block costs (a page of the layers' KVCacheSpec a KV tensor), and the
KV tensors, in the backend's layout of those pages. Layers of different KV-cache groups share tensors
slot-wise (turnout.attention.kv_spec): num_tensors is the slots this rank's layers use, every layer's where
there is one group."""

from __future__ import annotations

import math
import mmap

import torch

from turnout.attention.backend import AttentionBackend, AttentionSpec
from turnout.attention.kv_spec import KVCacheConfig, kv_cache_config
from turnout.config import EngineConfig
from turnout.errors import TurnoutError
from turnout.layers.attention import bind_attention_layers
from turnout.selection import Selection


def page_size_bytes(spec: AttentionSpec) -> int:
    """Bytes one block takes in one KV tensor: the page of the layers' KVCacheSpec (every layer's is one
    size, which kv_cache_config checks)."""
    return spec.kv_cache_specs()[0].page_size_bytes


def kv_bytes_per_block(spec: AttentionSpec, num_tensors: int | None = None) -> int:
    """Bytes one block takes over the KV tensors of this rank (num_tensors; None: one per attention
    layer), in the cache's dtype."""
    n = spec.num_layers if num_tensors is None else num_tensors
    return n * page_size_bytes(spec)


def blocks_in(budget_bytes: float, spec: AttentionSpec, num_tensors: int | None = None) -> int:
    """How many whole blocks fit in budget_bytes (0 when none do)."""
    return max(0, int(budget_bytes // kv_bytes_per_block(spec, num_tensors)))


def kv_bytes_for_tokens(
    spec: AttentionSpec, config: KVCacheConfig, num_tokens: int, chunk: int | None = None
) -> int:
    """KV bytes one request of num_tokens tokens holds at most on this rank (a single stage), computed in
    chunks of `chunk` tokens (None: decode): its blocks in every group, each over the group_size tensors."""
    return config.blocks_for_tokens(num_tokens, chunk) * kv_bytes_per_block(spec, config.group_size)


def allocate_kv_caches(
    backend: AttentionBackend,
    spec: AttentionSpec,
    num_blocks: int,
    device: torch.device,
    num_tensors: int | None = None,
) -> list[torch.Tensor]:
    """num_tensors zeroed tensors of spec.cache_dtype (None: one per attention layer, kv_caches[i] for the
    layer with layer_idx i), each of the backend's kv_cache_shape, which must hold num_blocks pages."""
    shape = backend.kv_cache_shape(
        num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, spec.kv_lora_rank
    )
    if math.prod(shape) * spec.cache_dtype.itemsize != num_blocks * page_size_bytes(spec):
        raise TurnoutError(
            f"attention backend {backend.name}'s kv_cache_shape {shape} for {num_blocks} blocks is not "
            f"{num_blocks} pages of {page_size_bytes(spec)} bytes ({spec.kv_cache_specs()[0].describe()})"
        )
    zeros = _lazy_zeros if device.type == "cpu" else torch.zeros
    n = spec.num_layers if num_tensors is None else num_tensors
    return [zeros(shape, dtype=spec.cache_dtype, device=device) for _ in range(n)]


def _lazy_zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros on the CPU from a private anonymous mapping, which the kernel hands out zeroed and
    page-aligned: a page is faulted in when a block first writes it, not all at start-up (memset over a
    fresh GiB costs 0.2-0.7 s of page faults). The tensor holds the mapping; freeing it unmaps."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def model_kv_cache_config(config: EngineConfig, selection: Selection) -> KVCacheConfig:
    """The KV-cache groups of the selected model over every layer (one stage), read from the model built
    on the meta device: no weights, no memory. For `turnout explain`; raises what the model's constructor
    raises."""
    config = selection.apply(config)
    cls = selection.architecture.load()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(selection.dtype)
    try:
        with torch.device("meta"):
            model = cls(selection.model_info.hf_config)
    finally:
        torch.set_default_dtype(prev)
    spec = bind_attention_layers(model, selection.dtype, config.block_size, selection.kv_cache_dtype)
    return kv_cache_config([spec.kv_cache_specs()])
