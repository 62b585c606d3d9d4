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
from turnout_gemma3 import layer_types

GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_activation -> GeluAndMul's approximate
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


class Gemma3MLP(nn.Module):
    """The GELU-gated feed-forward block: x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg["hidden_size"], [cfg["intermediate_size"]] * 2)
        self.down_proj = RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"])
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in GELU:
            raise TurnoutError(
                f"config.json sets hidden_activation = {act!r}, which Gemma3ForCausalLM does not implement "
                f"({', '.join(GELU)} only); use a model plugin that does"
            )
        self.act = GeluAndMul(GELU[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3Layer(nn.Module):
    """One decoder layer, each sub-block normed before and after, then added to the residual."""

    def __init__(self, cfg: dict[str, Any], sliding: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(cfg, sliding, rotary)
        self.mlp = Gemma3MLP(cfg)

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


class Gemma3Model(nn.Module):
    """This pipeline stage's layers between the scaled embedding and the final norm; the layers of one type
    share one rotary table (`rotary`, by layer type)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.start, self.end = layer_range(cfg["num_hidden_layers"])
        types = checked_layer_types(cfg)
        mine = types[self.start : self.end]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.rotary = nn.ModuleDict({t: make_rope(cfg, t) for t in sorted(set(mine))})
        self.layers = nn.ModuleList(Gemma3Layer(cfg, t == "sliding_attention", self.rotary[t]) for t in mine)
        self.norm = GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        # in the model's dtype, as HF rounds it: sqrt(3840) is not a bfloat16
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


class Gemma3ForCausalLM(DecoderForCausalLM):
    """turnout.models.CausalLM for Gemma3ForCausalLM checkpoints (model_type gemma3_text), tensor and
    pipeline parallel. Its layers are Gemma3Model's; the decoder's config check and its loader, which
    accounts for every checkpoint tensor part by part, serve it unchanged: the parameters carry HF's names,
    q/k/v and gate/up fused as there."""

    implemented_keys = frozenset({
        "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
        "rope_parameters", "hidden_act", "hidden_activation", "query_pre_attn_scalar",
    })  # fmt: skip

    def __init__(self, cfg: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # not the decoder's __init__: its layers are not Gemma 3's
        self.check_config(cfg)
        self.cfg, self.model = cfg, Gemma3Model(cfg)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        self.tie = bool(cfg.get("tie_word_embeddings", True))
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_soft_cap = cfg.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab_size], each l capped as cap * tanh(l / cap) where
        final_logit_softcapping is set."""
        logits = self.lm_head(hidden)
        if cap := self.final_soft_cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
