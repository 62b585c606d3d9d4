"""Qwen3MoeForCausalLM on the shared decoder. Layer i's feed-forward block is sparse when i is not in
mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule), else the dense MLP of intermediate_size.
A sparse block is a router (gate: [num_experts, hidden], on every rank) and turnout's FusedMoE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from turnout.layers import FusedMoE, num_experts
from turnout.models import DecoderForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, n = cfg["hidden_size"], num_experts(cfg)
        self.gate = nn.Linear(hidden, n, bias=False)
        self.experts = FusedMoE(
            n, cfg["num_experts_per_tok"], hidden, cfg["moe_intermediate_size"],
            renormalize=bool(cfg.get("norm_topk_prob", False)),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Each expert's checkpoint tensors (mlp.experts.<e>.gate_proj / up_proj / down_proj) go into the stacked
    FusedMoE weights of the experts this rank holds, accounted for one by one (expert_packed)."""

    qk_norm = True
    expert_packed = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}  # FusedMoE.weight_loader's shards

    def make_mlp(self, layer: int) -> nn.Module | None:
        cfg = self.cfg
        step = cfg.get("decoder_sparse_step") or 1
        if num_experts(cfg) and layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0:
            return Qwen3MoeSparseMoeBlock(cfg)
        return None
