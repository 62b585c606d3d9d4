"""Gemma2ForCausalLM from the public layers.

What sets it apart from the shared decoder: the embedding scaled by sqrt(hidden_size); four GemmaRMSNorms
per layer (each weight applied as 1 + w), the attention and MLP outputs normed before their residual add;
a tanh-GELU gate; a softmax scale of query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
attention layers alternating a sliding window with global attention (layer_types), every one capping its
scores (attn_logit_softcapping); and the final logits capped too (final_logit_softcapping).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from turnout import TurnoutError
from turnout.layers import Attention, QKVParallelLinear, RotaryEmbedding, RowParallelLinear
from turnout.models import GemmaDecoderLayer, GemmaForCausalLM, GemmaModel
from turnout_gemma2 import layer_types


class Gemma2Attention(nn.Module):
    """q/k/v, rotary, and one Attention of scale query_pre_attn_scalar ** -0.5, capped scores and, on a
    sliding layer, the window; positions [T], x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: dict[str, Any], layer: int) -> None:
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_size, bias = cfg.get("head_dim") or hidden // heads, cfg.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * self.head_size, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        rope = cfg.get(key) or {}
        base = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
        try:
            self.rotary = RotaryEmbedding(self.head_size, cfg["max_position_embeddings"], base, rope or None)
        except ValueError as e:
            raise TurnoutError(f"config.json's {key}: {e}; use a model plugin that implements it") from None
        sliding = layer_types(cfg)[layer] == "sliding_attention"
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_size, cfg["query_pre_attn_scalar"] ** -0.5,
            sliding_window=cfg.get("sliding_window") if sliding else None,
            logits_soft_cap=cfg.get("attn_logit_softcapping"),
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], -1)
        q, k = self.rotary(positions, q.view(-1, h, d), k.view(-1, hkv, d))
        return self.o_proj(self.attn(q, k, v.view(-1, hkv, d)))


class Gemma2ForCausalLM(GemmaForCausalLM):
    """turnout.models.CausalLM for Gemma2ForCausalLM checkpoints, tensor and pipeline parallel: the Gemma
    decoder (turnout.models.gemma) around Gemma2Attention."""

    implemented_keys = frozenset({
        "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping", "hidden_act",
        "hidden_activation", "query_pre_attn_scalar",
    })  # fmt: skip

    def build_model(self, cfg: dict[str, Any]) -> GemmaModel:
        """The Gemma decoder, layer i attending through Gemma2Attention(cfg, i)."""
        return GemmaModel(cfg, lambda i: GemmaDecoderLayer(cfg, Gemma2Attention(cfg, i), "Gemma2ForCausalLM"))
