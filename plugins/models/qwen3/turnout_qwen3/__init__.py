"""Qwen3 (per-head q/k RMSNorm) and Qwen2 (qkv bias)."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    return [
        ModelArchitecture("Qwen3ForCausalLM", "turnout_qwen3.model:Qwen3ForCausalLM"),
        ModelArchitecture("Qwen2ForCausalLM", "turnout_qwen3.model:Qwen2ForCausalLM"),
    ]
