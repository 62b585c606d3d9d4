"""Gemma3ForCausalLM (text) from the public layers, as HF's modeling_gemma3 computes it.

Gemma 2's layer: the embedding scaled by sqrt(hidden_size), four GemmaRMSNorms per layer (each weight applied
as 1 + w; the attention and MLP outputs normed before their residual add), a tanh-GELU gate and a softmax
scale of query_pre_attn_scalar ** -0.5. Gemma 3 adds a GemmaRMSNorm on each head of q and of k before the
rotation; local (sliding_attention) layers attending within sliding_window and global (full_attention) ones
(layer_types); and one rope per layer type, the global layers' at rope_theta with rope_scaling (linear, factor
8, in 4B-27B), the local layers' at rope_local_base_freq unscaled. Neither soft-cap is set by Gemma 3's
checkpoints; both are applied where config.json sets them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from turnout import TurnoutError
from turnout.layers import Attention, GemmaRMSNorm, QKVParallelLinear, RotaryEmbedding, RowParallelLinear
from turnout.models import GemmaDecoderLayer, GemmaForCausalLM, GemmaModel, layer_range
from turnout_gemma3 import layer_types

LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_rope(cfg: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the flat scaling dict) of one layer type, as HF's Gemma3TextConfig reads config.json:
    rope_parameters nested by layer type (transformers 5), whatever they leave out taken from the older keys,
    the global layers' rope_scaling and rope_theta (default 1e6), the local layers' rope_local_base_freq
    (default 10000, never scaled). A flat rope_parameters, which HF ignores, is a ValueError."""
    rope = cfg.get("rope_parameters") or {}
    if rope and not any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(
            "rope_parameters is one flat dict, which HF's Gemma3TextConfig ignores; nest it by layer type "
            '({"full_attention": {...}, "sliding_attention": {...}}) or use rope_theta, rope_scaling and '
            "rope_local_base_freq"
        )
    own = dict(rope.get(layer_type) or {})
    if layer_type == "full_attention":
        own.update(cfg.get("rope_scaling") or {})
        return own.pop("rope_theta", None) or cfg.get("rope_theta") or 1e6, own
    return own.pop("rope_theta", None) or cfg.get("rope_local_base_freq") or 10000.0, own


def make_rope(cfg: dict[str, Any], layer_type: str) -> RotaryEmbedding:
    """The one RotaryEmbedding the layers of layer_type share."""
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    try:
        base, scaling = gemma3_rope(cfg, layer_type)
        return RotaryEmbedding(head_size, cfg["max_position_embeddings"], base, scaling)
    except ValueError as e:
        raise TurnoutError(
            f"config.json's rope for {layer_type}: {e}; use a model plugin that implements it"
        ) from None


def checked_layer_types(cfg: dict[str, Any]) -> list[str]:
    """layer_types(cfg), refused in one line unless it gives each layer one of LAYER_TYPES."""
    types, n = layer_types(cfg), cfg["num_hidden_layers"]
    if len(types) != n or (odd := set(types) - set(LAYER_TYPES)):
        got = f"{len(types)} kinds" if len(types) != n else f"kinds {', '.join(sorted(odd))}"
        raise TurnoutError(
            f"config.json's layer_types give {got} for {n} layers; Gemma3ForCausalLM implements one of "
            f"{', '.join(LAYER_TYPES)} per layer: fix layer_types in config.json"
        )
    return types


class Gemma3Attention(nn.Module):
    """q/k/v, per-head q/k norms, its layer type's rotary, and one Attention of scale
    query_pre_attn_scalar ** -0.5 (on a local layer, within the window); positions [T], x [T, hidden] ->
    [T, hidden]."""

    def __init__(self, cfg: dict[str, Any], sliding: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_size, bias = cfg.get("head_dim") or hidden // heads, cfg.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * self.head_size, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_norm = GemmaRMSNorm(self.head_size, cfg["rms_norm_eps"])
        self.k_norm = GemmaRMSNorm(self.head_size, cfg["rms_norm_eps"])
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_size, cfg.get("query_pre_attn_scalar", 256) ** -0.5,
            sliding_window=cfg.get("sliding_window") if sliding else None,
            logits_soft_cap=cfg.get("attn_logit_softcapping"),
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], -1)
        q, k = self.rotary(positions, q.view(-1, h, d), k.view(-1, hkv, d), self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v.view(-1, hkv, d)))


class Gemma3Model(GemmaModel):
    """The Gemma decoder over Gemma3Attention; the layers of one type share one rotary table (`rotary`, by
    layer type)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        start, end = layer_range(cfg["num_hidden_layers"])
        types = checked_layer_types(cfg)
        rotary = nn.ModuleDict({t: make_rope(cfg, t) for t in sorted(set(types[start:end]))})

        def layer(i: int) -> GemmaDecoderLayer:
            attn = Gemma3Attention(cfg, types[i] == "sliding_attention", rotary[types[i]])
            return GemmaDecoderLayer(cfg, attn, "Gemma3ForCausalLM")

        super().__init__(cfg, layer)
        self.rotary = rotary


class Gemma3ForCausalLM(GemmaForCausalLM):
    """turnout.models.CausalLM for Gemma3ForCausalLM checkpoints (model_type gemma3_text), tensor and
    pipeline parallel: the Gemma decoder (turnout.models.gemma) around Gemma3Attention."""

    implemented_keys = frozenset({
        "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
        "rope_parameters", "hidden_act", "hidden_activation", "query_pre_attn_scalar",
    })  # fmt: skip

    def build_model(self, cfg: dict[str, Any]) -> GemmaModel:
        """Gemma3Model: one rotary table per layer type."""
        return Gemma3Model(cfg)
