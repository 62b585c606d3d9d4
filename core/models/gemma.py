"""The Gemma family's shared decoder (Gemma 2 and Gemma 3 build on it): the embedding scaled by
sqrt(hidden_size), four GemmaRMSNorms per layer (each weight applied as 1 + w; the attention and MLP outputs
normed before their residual add), a GELU-gated MLP, and the final logits capped where
final_logit_softcapping is set. A model supplies its attention block per layer; the decoder's config check
and its per-part loader serve it unchanged (parameters carry HF's names, q/k/v and gate/up fused)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from turnout.distributed import get_parallel_state
from turnout.errors import TurnoutError
from turnout.layers import (
    GeluAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from turnout.models.decoder import DecoderForCausalLM, layer_range

GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_activation -> GeluAndMul's approximate


class GemmaMLP(nn.Module):
    """The GELU-gated feed-forward block: x [T, hidden] -> [T, hidden]; arch names the model in the refusal
    of a hidden_activation it does not implement."""

    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg["hidden_size"], [cfg["intermediate_size"]] * 2)
        self.down_proj = RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"])
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in GELU:
            raise TurnoutError(
                f"config.json sets hidden_activation = {act!r}, which {arch} does not implement "
                f"({', '.join(GELU)} only); use a model plugin that does"
            )
        self.act = GeluAndMul(GELU[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """One decoder layer around self_attn ((positions, x) -> x), each sub-block normed before and after,
    then added to the residual."""

    def __init__(self, cfg: dict[str, Any], self_attn: nn.Module, arch: str) -> None:
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = self_attn
        self.mlp = GemmaMLP(cfg, arch)

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


class GemmaModel(nn.Module):
    """This pipeline stage's layers (make_layer(i) for each of its layer indices i) between the scaled
    embedding and the final norm."""

    def __init__(self, cfg: dict[str, Any], make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.start, self.end = layer_range(cfg["num_hidden_layers"])
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(make_layer(i) for i in range(self.start, self.end))
        self.norm = GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        # in the model's dtype, as HF rounds it: sqrt(hidden_size) is rarely a bfloat16
        self.register_buffer("embed_scale", torch.tensor(cfg["hidden_size"] ** 0.5), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This stage's output: the final norm's on the last stage, else (x, residual) stacked for the next;
        intermediate is the previous stage's stack."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        else:
            x, residual = intermediate[0], intermediate[1]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if not get_parallel_state().is_last_pp:
            return torch.stack([x, residual])
        return self.norm(x, residual)[0]


class GemmaForCausalLM(DecoderForCausalLM):
    """A Gemma CausalLM: build_model(cfg) gives its GemmaModel; the LM head (tied unless config.json says
    otherwise) and the final soft-cap are the family's."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # not the decoder's __init__: its layers are not Gemma's
        self.check_config(cfg)
        self.cfg, self.model = cfg, self.build_model(cfg)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        self.tie = bool(cfg.get("tie_word_embeddings", True))
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_soft_cap = cfg.get("final_logit_softcapping")

    def build_model(self, cfg: dict[str, Any]) -> GemmaModel:
        """This model's GemmaModel; a subclass gives its own attention blocks here."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab_size], each l capped as cap * tanh(l / cap) where
        final_logit_softcapping is set."""
        logits = self.lm_head(hidden)
        if cap := self.final_soft_cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
