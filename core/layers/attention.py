"""The Attention layer: projections are the model's, the paged attention itself is the chosen backend's.

The model runner finds every Attention layer by walking the model's modules (`bind_attention_layers`),
numbers them, and publishes each step's metadata and KV caches through `forward_context`; every layer
reads it, so models never see backends. This is also where piecewise CUDA graphs put their hole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from turnout.attention.backend import AttentionImpl, AttentionLayerSpec, AttentionMetadata, AttentionSpec
from turnout.errors import TurnoutError


@dataclass
class ForwardContext:
    """What the Attention layers of one forward read: each layer's AttentionImpl, the step's metadata of
    KV-cache group 0 (`meta`) and of every group (`metas`, empty where there is one group), and each layer's
    KV cache."""

    impls: list[AttentionImpl]  # one per Attention layer of this rank, indexed by its layer_idx
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per Attention layer of this rank, indexed by its layer_idx
    # set while piecewise CUDA graphs are captured: attention becomes a hole between two graphs
    hole: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    metas: tuple[AttentionMetadata, ...] = ()  # by KV-cache group

    def group_meta(self, group: int) -> AttentionMetadata:
        """The metadata of KV-cache group `group` (its block_table and slot_mapping)."""
        return self.metas[group] if group else self.meta


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
    """Paged causal attention over q, k, v of this rank's heads (under tensor parallelism, num_heads and
    num_kv_heads are the per-rank counts). The layer owns no weights.

    Each layer may set its own scale, a sliding_window (a query attends to its latest sliding_window keys,
    its own included) and a logits_soft_cap (scores s -> cap * tanh(s / cap)); the model's ModelArchitecture
    declares the features its layers use (attention_features), so selection picks a backend that serves
    them.

    kv_lora_rank: multi-head latent attention in absorbed form (turnout.attention's "mla" spec): one KV
    head whose k of head_size is the cached latent vector; v is k[..., :kv_lora_rank], and the output
    [T, H * kv_lora_rank]."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_lora_rank: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or at least 1, not {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be None or positive, not {logits_soft_cap}")
        if kv_lora_rank is not None and (sliding_window is not None or num_kv_heads != 1):
            raise ValueError("multi-head latent attention (kv_lora_rank) takes one KV head and no window")
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = (
            num_heads,
            num_kv_heads,
            head_size,
            scale,
        )
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.kv_lora_rank = kv_lora_rank
        # an FP8 KV cache's scales of this layer: vLLM's 1.0 unless a loader sets the checkpoint's
        self.k_scale, self.v_scale = 1.0, 1.0
        self.layer_idx: int | None = None  # set by bind_attention_layers: this layer's KV cache
        self.layer_spec: AttentionLayerSpec | None = None  # likewise: what its AttentionImpl is made with
        self.kv_cache_group = 0  # set by bind_kv_cache_groups: whose block table this layer reads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D] (under MLA v [T, 1, kv_lora_rank] -> [T, H *
        kv_lora_rank])."""
        ctx = get_forward_context()
        if ctx.hole is not None:
            return ctx.hole(self.layer_idx, q, k, v)
        meta = ctx.group_meta(self.kv_cache_group)
        out = ctx.impls[self.layer_idx].forward(q, k, v, ctx.kv_caches[self.layer_idx], meta)
        return out.reshape(q.shape[0], -1)


def bind_attention_layers(
    model: nn.Module, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto"
) -> AttentionSpec:
    """Number the model's Attention layers 0..n-1 in module order (layer i reads and writes kv_caches[i])
    and return the AttentionSpec they share, with each layer's own features (and KV scales) in its
    `layers`, over a KV cache of kv_cache_dtype."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise TurnoutError(
            f"model {type(model).__name__} has no turnout.layers.Attention layer; "
            "its attention must call one (see docs/writing-a-plugin.md)"
        )
    shapes = {(m.num_heads, m.num_kv_heads, m.head_size, m.kv_lora_rank) for m in layers}
    if len(shapes) > 1:
        raise TurnoutError(
            f"model {type(model).__name__}'s Attention layers differ in (heads, KV heads, head size, "
            f"kv_lora_rank): {sorted(shapes, key=str)}; turnout's paged KV cache needs one shape for every "
            "layer"
        )
    for i, m in enumerate(layers):
        m.layer_idx = i
        m.layer_spec = AttentionLayerSpec(
            i, m.scale, m.sliding_window, m.logits_soft_cap, k_scale=m.k_scale, v_scale=m.v_scale
        )
    heads, kv_heads, head_size, kv_lora_rank = shapes.pop()
    specs = tuple(m.layer_spec for m in layers)
    return AttentionSpec(
        heads, kv_heads, head_size, dtype, block_size, layers[0].scale, len(layers), specs, kv_cache_dtype,
        kv_lora_rank,
    )  # fmt: skip


def bind_kv_cache_groups(model: nn.Module, groups: list[int]) -> None:
    """Give the Attention layer with layer_idx i KV-cache group groups[i] (after bind_attention_layers)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.kv_cache_group = groups[m.layer_idx]
