"""Qwen3MoeForCausalLM on the shared decoder. Layer i's feed-forward block is sparse when i is not in
mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule), else the dense MLP of intermediate_size.
A sparse block is a router (gate: [num_experts, hidden], on every rank) and turnout's FusedMoE."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from turnout.layers import FusedMoE, num_experts
from turnout.models import DecoderForCausalLM

# one expert's projection in the checkpoint -> (FusedMoE parameter, shard id of its weight_loader)
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_TARGET = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", 2)}
_SHARDS = {"w13_weight": 2, "w2_weight": 1}  # checkpoint tensors per expert


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
    qk_norm = True

    def make_mlp(self, layer: int) -> nn.Module | None:
        cfg = self.cfg
        step = cfg.get("decoder_sparse_step") or 1
        if num_experts(cfg) and layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0:
            return Qwen3MoeSparseMoeBlock(cfg)
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors go into the stacked w13 / w2 of the experts this rank holds (the others are
        skipped); the rest load as in the dense decoder. A stacked weight counts as loaded once every expert
        it holds got all its tensors."""
        params = dict(self.named_parameters())
        copied: Counter[str] = Counter()

        def not_experts() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _EXPERT.fullmatch(name)
                if m is None:
                    yield name, tensor
                    continue
                prefix = self._local_name(m[1])  # None: a layer of another pipeline stage
                target, shard = _TARGET[m[3]]
                p = params.get(f"{prefix}.{target}")
                if p is not None and p.weight_loader(p, tensor, int(m[2]), shard):
                    copied[f"{prefix}.{target}"] += 1

        loaded = super().load_weights(not_experts())
        full = {n for n, c in copied.items() if c == params[n].shape[0] * _SHARDS[n.rsplit(".", 1)[1]]}
        return loaded | full
