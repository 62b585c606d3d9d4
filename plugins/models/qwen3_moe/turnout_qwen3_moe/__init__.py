"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder with sparse mixture-of-experts blocks."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    return [
        ModelArchitecture(
            "Qwen3MoeForCausalLM", "turnout_qwen3_moe.model:Qwen3MoeForCausalLM", expert_parallel=True
        )
    ]
