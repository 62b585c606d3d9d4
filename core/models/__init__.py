"""Models: the contract a model class implements (CausalLM), the registry entry a plugin returns
(ModelArchitecture), the shared dense decoder the bundled models build on, and the Gemma family's decoder
(turnout.models.gemma)."""

from typing import Any

from turnout.models.interface import CausalLM
from turnout.models.registry import ModelArchitecture

__all__ = [
    "CausalLM",
    "DecoderForCausalLM",
    "DecoderMLP",
    "GemmaDecoderLayer",
    "GemmaForCausalLM",
    "GemmaModel",
    "ModelArchitecture",
    "get_parallel_state",
    "layer_range",
]

_LAZY = {  # imported on first use: registering a model plugin must not build torch layers
    "DecoderForCausalLM": "turnout.models.decoder",
    "DecoderMLP": "turnout.models.decoder",
    "layer_range": "turnout.models.decoder",
    "GemmaDecoderLayer": "turnout.models.gemma",
    "GemmaForCausalLM": "turnout.models.gemma",
    "GemmaModel": "turnout.models.gemma",
    "get_parallel_state": "turnout.distributed",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'turnout.models' has no attribute {name!r}")
