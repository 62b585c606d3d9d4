"""A model plugin maps HF `architectures` names to lazily imported classes."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turnout.models.interface import CausalLM


@dataclass(frozen=True)
class ModelArchitecture:
    name: str  # as in config.json "architectures", e.g. "LlamaForCausalLM"
    target: str  # "package.module:ClassName", imported only when chosen
    priority: int = 0

    def load(self) -> type[CausalLM]:
        """The class the target names; instances must implement turnout.models.CausalLM."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)
