"""DeepseekV2ForCausalLM from the public layers, as HF transformers' modeling_deepseek_v2 computes it.

Multi-head latent attention over the latent KV cache. q comes from q_proj, or where q_lora_rank is set from
q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa gives the compressed kv (kv_lora_rank) and one
k_pe (qk_rope_head_dim) shared by every head. HF expands the compressed kv through kv_a_layernorm ->
kv_b_proj into each head's k_nope and v, and attends over cat(k_nope, k_pe) with cat(q_nope, q_pe), the
rotary applied to the rope parts as HF applies it: interleaved pairs (2i, 2i + 1), complex-style, in float32.
The softmax scale is qk_head_dim ** -0.5, times mscale ** 2 where rope scaling sets mscale_all_dim (YaRN).

**The KV cache holds the latent vector, cat(kv_a_layernorm(compressed kv), k_pe): kv_lora_rank +
qk_rope_head_dim values a token and layer** (DeepSeek-V2-Lite: 512 + 64 = 576, where per-head K and V take
2 x 16 x 192 = 6,144), the "mla" KV-cache spec. Attention runs in absorbed form, as DeepSeek and vLLM decode:
kv_b_proj splits per head into W_UK (to k_nope) and W_UV (to v), and since q_nope . (W_UK c) = (q_nope W_UK)
. c, each head's query is cat(q_nope W_UK, q_pe) against the one cached latent head, whose first
kv_lora_rank dims are the values; a head's output (kv_lora_rank wide) times W_UV is its v-weighted sum. The
same form serves prefill: exact there too, at more FLOPs than expanding the keys (kv_lora_rank + rope dims a
score instead of qk_head_dim), and one code path for every step.

Feed-forward: the first first_k_dense_replace layers are a dense SwiGLU MLP of intermediate_size; the rest
route each token to num_experts_per_tok of n_routed_experts experts on turnout's FusedMoE (softmax scores in
float32; topk_method "greedy", or "group_limited_greedy": the top topk_group of n_group groups by their best
score, then the top-k within them; the weights times routed_scaling_factor, not renormalised) and add
n_shared_experts experts as one dense MLP of moe_intermediate_size * n_shared_experts. Config values this
class does not implement (another topk_method or scoring_func, norm_topk_prob, moe_layer_freq other than 1,
fewer KV heads than heads) are refused in one line through math_keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from turnout import TurnoutError
from turnout.layers import (
    Attention,
    ColumnParallelLinear,
    FusedMoE,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    num_experts,
    rope_parameters_for,
)
from turnout.models import DecoderForCausalLM, DecoderMLP, get_parallel_state, layer_range

LORA_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm take the norm's default eps, not rms_norm_eps


def _unless(*implemented: Any) -> Callable[[Any], Any]:
    """The value where it is none of `implemented` (None: nothing to refuse)."""
    return lambda v: None if v in implemented else v


# DeepSeek's config.json keys that change the math: key -> cfg -> the value this class does not implement
DEEPSEEK_KEYS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "topk_method": lambda c: _unless(None, "greedy", "group_limited_greedy")(c.get("topk_method")),
    "scoring_func": lambda c: _unless(None, "softmax")(c.get("scoring_func")),
    "norm_topk_prob": lambda c: c.get("norm_topk_prob") or None,
    "moe_layer_freq": lambda c: _unless(None, 1)(c.get("moe_layer_freq")),
    "num_key_value_heads": lambda c: _unless(None, c["num_attention_heads"])(c.get("num_key_value_heads")),
}


def softmax_scale(cfg: dict[str, Any], scaling: dict[str, Any]) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 (YaRN's 0.1 mscale_all_dim ln(factor) + 1) where a rope scaling
    sets mscale_all_dim, as HF's yarn_apply_mscale folds it in."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default" and (all_dim := scaling.get("mscale_all_dim")):
        factor = scaling["factor"]
        mscale = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


def make_rope(cfg: dict[str, Any]) -> tuple[RotaryEmbedding, float]:
    """The RotaryEmbedding of the rope dims (qk_rope_head_dim) every layer shares, and the softmax scale."""
    base, scaling = rope_parameters_for(cfg)
    try:
        rotary = RotaryEmbedding(cfg["qk_rope_head_dim"], cfg["max_position_embeddings"], base, scaling)
    except ValueError as e:
        raise TurnoutError(
            f"config.json's rope scaling: {e}; use a model plugin that implements it"
        ) from None
    return rotary, softmax_scale(cfg, scaling)


def rotate_interleaved(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, h, r] rotated at positions [T] as HF's DeepSeek-V2 does: each pair (2i, 2i + 1) a complex number
    times cos + i sin of its frequency (the table's attention factor included), in float32, then back to x's
    dtype."""
    cos, sin = rotary.cos[positions][:, None], rotary.sin[positions][:, None]  # [T, 1, r / 2]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2).to(x.dtype)


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention in absorbed form over the latent KV cache (see the module docstring):
    positions [T], x [T, hidden] -> [T, hidden]. Under tensor parallelism each rank holds num_heads / tp heads
    (q_proj or q_b_proj, kv_b_proj and o_proj split by heads) and the whole latent cache; q_a_proj and
    kv_a_proj_with_mqa are whole on every rank."""

    def __init__(self, cfg: dict[str, Any], rotary: RotaryEmbedding, scale: float) -> None:
        super().__init__()
        # selection refuses a tensor_parallel_size that does not divide the heads (ModelInfo)
        hidden, heads, tp = cfg["hidden_size"], cfg["num_attention_heads"], get_parallel_state().tp_size
        self.nope, self.rope, self.v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.kv_rank, self.q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        self.num_heads, qk = heads // tp, self.nope + self.rope
        bias = bool(cfg.get("attention_bias", False))
        if self.q_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LORA_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_rank, heads * qk)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LORA_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, 1, self.kv_rank + self.rope, scale, kv_lora_rank=self.kv_rank)
        self.w_kv_b: torch.Tensor | None = None  # a quantized kv_b_proj's weight, read once

    def absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, qk_nope, kv_lora_rank] and W_UV [H, v_head_dim, kv_lora_rank]: this rank's heads of
        kv_b_proj's weight (views). A quantized kv_b_proj's weight is the one its GEMM computes with, read
        off the identity at the first forward (the weights are fixed once loaded)."""
        lin = self.kv_b_proj
        if lin.quant_method is None:
            w = lin.weight
        else:
            if self.w_kv_b is None:
                self.w_kv_b = lin(torch.eye(self.kv_rank, dtype=dtype, device=lin.weight.device)).t()
            w = self.w_kv_b
        return w.view(self.num_heads, self.nope + self.v_dim, self.kv_rank).split([self.nope, self.v_dim], 1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, h, r = x.shape[0], self.num_heads, self.kv_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_rank else self.q_proj(x)
        q = q.view(t, h, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope], -1)
        w_uk, w_uv = self.absorbed(x.dtype)
        q_latent = torch.einsum("thn,hnr->thr", q[..., : self.nope], w_uk)
        q_pe = rotate_interleaved(self.rotary, positions, q[..., self.nope :])
        k_pe = rotate_interleaved(self.rotary, positions, k_pe[:, None])  # [T, 1, rope]
        k = torch.cat([self.kv_a_layernorm(latent)[:, None], k_pe], -1)  # [T, 1, r + rope]: what is cached
        out = self.attn(torch.cat([q_latent, q_pe], -1), k, k[..., :r]).view(t, h, r)
        return self.o_proj(torch.einsum("thr,hvr->thv", out, w_uv).reshape(t, h * self.v_dim))


def deepseek_routing(cfg: dict[str, Any]) -> Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, ...]]:
    """FusedMoE's custom_routing_function for DeepSeek-V2's router, as HF's DeepseekV2TopkRouter: softmax over
    the logits in float32; "group_limited_greedy" keeps the topk_group of n_group groups with the highest best
    score (the others' scores 0); top-k; the weights times routed_scaling_factor."""
    n, method = num_experts(cfg), cfg.get("topk_method") or "greedy"
    scaling, groups, keep = cfg.get("routed_scaling_factor"), cfg.get("n_group"), cfg.get("topk_group")
    if method == "group_limited_greedy" and not (groups and keep and n % groups == 0 and keep <= groups):
        raise TurnoutError(
            f"config.json's topk_method group_limited_greedy needs n_group dividing n_routed_experts ({n}) "
            f"and topk_group <= n_group, but gives n_group = {groups}, topk_group = {keep}; fix config.json"
        )

    def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.softmax(-1, dtype=torch.float32)
        if method == "group_limited_greedy":
            best = scores.view(-1, groups, n // groups).amax(-1)  # [T, n_group]
            chosen = torch.zeros_like(best).scatter_(1, torch.topk(best, keep, dim=-1, sorted=False)[1], 1.0)
            scores = scores.masked_fill(~chosen.bool().repeat_interleave(n // groups, 1), 0.0)
        weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
        return (weights * scaling if scaling is not None else weights), ids

    return route


class DeepseekV2MoE(nn.Module):
    """The router (gate, float32, on every rank), the routed experts on FusedMoE and the shared experts as one
    dense MLP added to their output: x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, n, inter = cfg["hidden_size"], num_experts(cfg), cfg["moe_intermediate_size"]
        self.gate = nn.Linear(hidden, n, bias=False, dtype=torch.float32)  # HF keeps the router in float32
        self.experts = FusedMoE(
            n, cfg["num_experts_per_tok"], hidden, inter, renormalize=False,
            custom_routing_function=deepseek_routing(cfg),
        )  # fmt: skip
        shared = cfg.get("n_shared_experts") or 0
        self.shared_experts = DecoderMLP(hidden, inter * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, F.linear(x.float(), self.gate.weight.float()))
        return y + self.shared_experts(x) if self.shared_experts is not None else y


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm: RMSNorm -> attention -> residual add -> RMSNorm -> dense MLP or MoE -> residual add."""

    def __init__(self, cfg: dict[str, Any], layer: int, rotary: RotaryEmbedding, scale: float) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = DeepseekV2Attention(cfg, rotary, scale)
        sparse = num_experts(cfg) and layer >= (cfg.get("first_k_dense_replace") or 0)
        self.mlp = DeepseekV2MoE(cfg) if sparse else DecoderMLP(hidden, cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual): the layer's input is x + residual (residual None: x)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class DeepseekV2Model(nn.Module):
    """This pipeline stage's layers between the embedding and the final norm; one rotary table for all."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.start, self.end = layer_range(cfg["num_hidden_layers"])
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.rotary, scale = make_rope(cfg)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(cfg, i, self.rotary, scale) for i in range(self.start, self.end)
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This stage's output: the final norm's on the last stage, else (x, residual) stacked for the next;
        intermediate is the previous stage's stack."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate[0], intermediate[1]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if not get_parallel_state().is_last_pp:
            return torch.stack([x, residual])
        return self.norm(x, residual)[0]


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """turnout.models.CausalLM for DeepseekV2ForCausalLM checkpoints (model_type deepseek_v2), tensor,
    pipeline and expert parallel. The decoder's config check (with DEEPSEEK_KEYS) and per-part loader serve
    it: the parameters carry HF's names, each dense MLP's gate_proj / up_proj fused, each routed expert's
    gate_proj / up_proj / down_proj in the stacked FusedMoE weights of the experts this rank holds."""

    math_keys = {**DecoderForCausalLM.math_keys, **DEEPSEEK_KEYS}
    expert_packed = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}  # FusedMoE.weight_loader's shards

    def __init__(self, cfg: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # not the decoder's __init__: its attention is not DeepSeek's
        self.check_config(cfg)
        self.cfg, self.model = cfg, DeepseekV2Model(cfg)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight
