"""Attention backends: capabilities for selection, a paged KV layout, and forward.

Shapes used throughout (T = tokens in the step, B = requests in the step):
  q: [T, num_heads, head_size]        k, v: [T, num_kv_heads, head_size]
  slot_mapping: [T] int64             slot = block_id * block_size + offset, -1 writes nowhere
  query_start_loc: [B + 1] int32      cu_seqlens of the queries
  seq_lens: [B] int32                 tokens in the KV cache after this step (context + query)
  block_table: [B, max_blocks] int32  block ids of each request, padded with 0
Query token i of request b sits at position seq_lens[b] - query_len[b] + i and attends causally to
every cached token up to and including that position.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from turnout.errors import ConfigError
from turnout.platform import Platform


class CudagraphSupport(enum.IntEnum):
    """Which batches a backend can replay from a CUDA graph with static metadata buffers."""

    NEVER = 0
    UNIFORM_DECODE = 1  # every request runs exactly one token
    UNIFORM_BATCH = 2  # every request runs the same number of tokens
    ALWAYS = 3  # any batch

    @classmethod
    def from_env(cls, name: str, default: CudagraphSupport) -> CudagraphSupport:
        """A backend's declared level, or the one the environment variable `name` sets (to try a capture on
        a new library version, or to turn graphs off around a backend)."""
        value = os.environ.get(name, "").strip().upper()
        if not value:
            return default
        if value not in cls.__members__:
            raise ConfigError(
                f"{name}={value!r} is not a CUDA-graph support level; use one of {', '.join(cls.__members__)}"
            )
        return cls[value]


@dataclass(frozen=True)
class AttentionContext:
    """What selection knows when it asks a backend whether it can serve."""

    platform: Platform
    dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int  # T without graph padding
    num_decode_tokens: int = 0  # requests running exactly one token (they come first when ordered)
    backend_data: Any = None  # whatever the backend's build_metadata returned

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def uniform_decode(self) -> bool:
        """Every request runs exactly one token (and there is no graph padding)."""
        return self.max_query_len == 1 and self.num_actual_tokens == self.num_reqs


class AttentionBackend:
    """Base class. Subclasses set the class attributes and implement kv_cache_shape and forward."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any head size
    block_size_multiple: ClassVar[int] = 1  # block_size must be a multiple of this
    min_capability: ClassVar[tuple[int, int] | None] = None
    cudagraph_support: ClassVar[CudagraphSupport] = CudagraphSupport.NEVER

    def import_error(self) -> str | None:
        """Import the heavy library; return why it is unusable, or None. Called only when checked."""
        return None

    def check(self, ctx: AttentionContext) -> list[str]:
        """Every reason this backend cannot serve ctx; empty means it can."""
        p = ctx.platform
        reasons = []
        if p.device_type not in self.device_types:
            reasons.append(f"needs device {'/'.join(self.device_types)}, have {p.device_type}")
        elif self.min_capability and (p.capability or (0, 0)) < self.min_capability:
            need = "%d.%d" % self.min_capability
            reasons.append(f"needs compute capability >= {need}, have {p.capability}")
        if ctx.dtype not in self.dtypes:
            ok = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"dtype {str(ctx.dtype).removeprefix('torch.')} unsupported (supports {ok})")
        if self.head_sizes is not None and ctx.head_size not in self.head_sizes:
            reasons.append(f"head size {ctx.head_size} unsupported (supports {list(self.head_sizes)})")
        if ctx.block_size % self.block_size_multiple:
            reasons.append(f"block_size {ctx.block_size} is not a multiple of {self.block_size_multiple}")
        if ctx.num_heads % ctx.num_kv_heads:
            reasons.append(f"num_heads {ctx.num_heads} not divisible by num_kv_heads {ctx.num_kv_heads}")
        if not reasons and (err := self.import_error()):
            reasons.append(err)
        return reasons

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        """Shape of one layer's KV cache tensor."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, meta: AttentionMetadata) -> Any:
        """Once per step, before the forward: plan kernels, precompute indices. Stored in backend_data.

        For FULL CUDA graphs the runner calls it on static metadata buffers before capture and again
        before every replay: whatever tensors forward reads must then be updated in place, not replaced.
        While a graph is captured, meta's host ints (max_query_len, max_seq_len) are upper bounds."""
        return None

    def prepare_cudagraphs(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        """Called once before any FULL capture: size static buffers for the largest batch and block table."""

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write k, v into kv_cache at meta.slot_mapping, then attend. Returns [T, num_heads, head_size]."""
        raise NotImplementedError
