"""MixtralForCausalLM on the shared decoder. Every layer's feed-forward block is sparse: a router (gate:
[num_local_experts, hidden], on every rank) whose top num_experts_per_tok softmax weights are renormalised
to sum to 1, and turnout's FusedMoE over experts w1 (gate), w3 (up) and w2 (down). Every layer attends within
config.json's sliding_window where it sets one."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from turnout.layers import Attention, FusedMoE, num_experts
from turnout.models import DecoderForCausalLM

# one expert's projection in the checkpoint -> (FusedMoE parameter, shard id of its weight_loader)
_EXPERT = re.compile(r"(.+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_TARGET = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 2)}
_SHARDS = {"w13_weight": 2, "w2_weight": 1}  # checkpoint tensors per expert


class MixtralSparseMoeBlock(nn.Module):
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
    """Mistral's decoder (its sliding_window included) with MixtralSparseMoeBlock as every layer's mlp."""

    implemented_keys = frozenset({"sliding_window"})

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        if window := cfg.get("sliding_window"):
            for layer in self.model.layers:
                a = layer.self_attn.attn
                layer.self_attn.attn = Attention(
                    a.num_heads, a.num_kv_heads, a.head_size, a.scale, sliding_window=window
                )

    def make_mlp(self, layer: int) -> nn.Module:
        return MixtralSparseMoeBlock(self.cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors go into the stacked w13 / w2 of the experts this rank holds (the others are
        skipped), the router as mlp.gate; the rest load as in the dense decoder. A stacked weight counts as
        loaded once every expert it holds got all its tensors."""
        params = dict(self.named_parameters())
        copied: Counter[str] = Counter()

        def not_experts() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _EXPERT.fullmatch(name)
                if m is None:
                    yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
                    continue
                prefix = self._local_name(m[1])  # None: a layer of another pipeline stage
                target, shard = _TARGET[m[3]]
                p = params.get(f"{prefix}.mlp.experts.{target}")
                if p is not None and p.weight_loader(p, tensor, int(m[2]), shard):
                    copied[f"{prefix}.mlp.experts.{target}"] += 1

        loaded = super().load_weights(not_experts())
        full = {n for n, c in copied.items() if c == params[n].shape[0] * _SHARDS[n.rsplit(".", 1)[1]]}
        return loaded | full
