"""A model plugin maps HF `architectures` names to lazily imported classes, and declares what the class
can do, so selection refuses a configuration it cannot serve before any worker starts."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnout.models.interface import CausalLM


@dataclass(frozen=True)
class ModelArchitecture:
    """name: as in config.json "architectures", e.g. "LlamaForCausalLM"; target: "package.module:Class",
    imported only when chosen. The class declares what it implements:

    - tensor_parallel: its linear layers split over tensor_parallel_size ranks (the core's parallel layers);
    - pipeline_parallel: it builds only its stage's layers (`turnout.models.layer_range`) and takes and
      returns the intermediate hidden states between stages;
    - expert_parallel: it is a MoE model whose experts go through the core's FusedMoE, which partitions
      them (enable_expert_parallel);
    - attention_features: a module-level function of config.json (a dict) giving the per-layer features
      (turnout.attention.LAYER_FEATURES) its Attention layers use for that checkpoint: a sliding window,
      a logit soft-cap, scales that differ between layers. None: plain causal attention at one scale.
      Selection refuses the backends that do not declare them.
    """

    name: str
    target: str
    priority: int = 0
    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    expert_parallel: bool = False
    attention_features: Callable[[dict[str, Any]], Iterable[str]] | None = None

    def load(self) -> type[CausalLM]:
        """The class the target names; instances must implement turnout.models.CausalLM."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)

    def layer_features(self, hf_config: dict[str, Any]) -> frozenset[str]:
        """The per-layer attention features this class's layers use for the checkpoint of hf_config."""
        from turnout.attention.backend import LAYER_FEATURES  # at call time: registering imports no torch

        if self.attention_features is None:
            return frozenset()
        used = frozenset(self.attention_features(hf_config))
        if unknown := sorted(used - set(LAYER_FEATURES)):
            raise ValueError(
                f"{self.name}: attention_features gave {unknown}; known: {', '.join(LAYER_FEATURES)}"
            )
        return used

    def problems(self, tp: int, pp: int, expert_parallel: bool) -> list[str]:
        """Why this class cannot run tensor_parallel_size tp, pipeline_parallel_size pp and
        enable_expert_parallel, from what it declares; empty if it can."""
        why = []
        if tp > 1 and not self.tensor_parallel:
            why.append(f"{self.name} declares no tensor parallelism; set tensor_parallel_size = 1 ({tp})")
        if pp > 1 and not self.pipeline_parallel:
            why.append(f"{self.name} declares no pipeline parallelism; set pipeline_parallel_size = 1 ({pp})")
        if expert_parallel and not self.expert_parallel:
            why.append(f"{self.name} declares no expert parallelism; leave enable_expert_parallel off")
        return why
