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
from turnout.layers import (
    Attention,
    GeluAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from turnout.models import DecoderForCausalLM, get_parallel_state, layer_range
from turnout_gemma2 import layer_types

GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_activation -> GeluAndMul's approximate


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


class Gemma2MLP(nn.Module):
    """The GELU-gated feed-forward block: x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg["hidden_size"], [cfg["intermediate_size"]] * 2)
        self.down_proj = RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"])
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in GELU:
            raise TurnoutError(
                f"config.json sets hidden_activation = {act!r}, which Gemma2ForCausalLM does not implement "
                f"({', '.join(GELU)} only); use a model plugin that does"
            )
        self.act = GeluAndMul(GELU[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma2Layer(nn.Module):
    """One decoder layer, each sub-block normed before and after, then added to the residual."""

    def __init__(self, cfg: dict[str, Any], layer: int) -> None:
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma2Attention(cfg, layer)
        self.mlp = Gemma2MLP(cfg)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual): the layer's input is x + residual (residual None: x)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(nn.Module):
    """This pipeline stage's layers between the scaled embedding and the final norm."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.start, self.end = layer_range(cfg["num_hidden_layers"])
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Gemma2Layer(cfg, i) for i in range(self.start, self.end))
        self.norm = GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        # in the model's dtype, as HF rounds it: sqrt(2304) is not a bfloat16
        self.register_buffer("embed_scale", torch.tensor(cfg["hidden_size"] ** 0.5), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        else:
            x, residual = intermediate[0], intermediate[1]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if not get_parallel_state().is_last_pp:
            return torch.stack([x, residual])
        return self.norm(x, residual)[0]


class Gemma2ForCausalLM(DecoderForCausalLM):
    """turnout.models.CausalLM for Gemma2ForCausalLM checkpoints, tensor and pipeline parallel. Its layers
    are Gemma2Model's; the decoder's config check and its loader, which accounts for every checkpoint tensor
    part by part, serve it unchanged: the parameters carry HF's names, q/k/v and gate/up fused as there."""

    implemented_keys = frozenset({
        "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping", "hidden_act",
        "hidden_activation", "query_pre_attn_scalar",
    })  # fmt: skip

    def __init__(self, cfg: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # not the decoder's __init__: its layers are not Gemma 2's
        self.check_config(cfg)
        self.cfg, self.model = cfg, Gemma2Model(cfg)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        self.tie = bool(cfg.get("tie_word_embeddings", True))
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_soft_cap = cfg.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab_size], each l capped as cap * tanh(l / cap)."""
        logits = self.lm_head(hidden)
        if cap := self.final_soft_cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
