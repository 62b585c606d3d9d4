"""MixtralForCausalLM on the shared decoder. Every layer's feed-forward block is sparse: a router (gate:
[num_local_experts, hidden], on every rank) whose top num_experts_per_tok softmax weights are renormalised
to sum to 1, and turnout's FusedMoE over experts w1 (gate), w3 (up) and w2 (down). Every layer attends within
config.json's sliding_window where it sets one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from turnout.layers import FusedMoE, num_experts
from turnout.models import DecoderForCausalLM


class MixtralSparseMoeBlock(nn.Module):
    """The router and the experts: x [T, hidden] -> [T, hidden], every rank's tokens through their top-k."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, n = cfg["hidden_size"], num_experts(cfg)
        self.gate = nn.Linear(hidden, n, bias=False)
        self.experts = FusedMoE(
            n, cfg["num_experts_per_tok"], hidden, cfg["intermediate_size"], renormalize=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MixtralForCausalLM(DecoderForCausalLM):
    """Mistral's decoder (its sliding_window included) with MixtralSparseMoeBlock as every layer's mlp,
    which the checkpoint names block_sparse_moe; each expert's w1 / w3 / w2 goes into the stacked FusedMoE
    weights of the experts this rank holds, accounted for one by one."""

    implemented_keys = frozenset({"sliding_window"})
    expert_packed = {"w1": 0, "w3": 1, "w2": 2}  # FusedMoE.weight_loader's shards

    def make_mlp(self, layer: int) -> nn.Module:
        return MixtralSparseMoeBlock(self.cfg)

    def checkpoint_parts(self) -> dict[str, Any]:
        """The decoder's, with each layer's mlp under the checkpoint's name for it, block_sparse_moe."""
        return {k.replace(".mlp.", ".block_sparse_moe.", 1): v for k, v in super().checkpoint_parts().items()}
