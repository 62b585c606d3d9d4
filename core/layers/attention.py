"""The Attention layer: projections are the model's, the paged attention itself is the chosen backend's.

The model runner publishes the step's metadata and KV caches through `forward_context`; every layer reads
it, so models never see backends. This is also where piecewise CUDA graphs put their hole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from turnout.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata


@dataclass
class ForwardContext:
    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer of this rank, indexed by local layer idx
    # set while piecewise CUDA graphs are captured: attention becomes a hole between two graphs
    hole: Callable[[AttentionLayerSpec, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


_ctx: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _ctx
    prev, _ctx = _ctx, ctx
    try:
        yield
    finally:
        _ctx = prev


def get_forward_context() -> ForwardContext:
    assert _ctx is not None, "Attention called outside forward_context"
    return _ctx


class Attention(nn.Module):
    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int, scale: float
    ) -> None:
        super().__init__()
        self.spec = AttentionLayerSpec(layer_idx, num_heads, num_kv_heads, head_size, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        ctx = get_forward_context()
        if ctx.hole is not None:
            return ctx.hole(self.spec, q, k, v)
        out = ctx.backend.forward(self.spec, q, k, v, ctx.kv_caches[self.spec.layer_idx], ctx.meta)
        return out.reshape(q.shape[0], -1)
