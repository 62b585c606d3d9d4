"""Phi-3, Phi-3.5 and Phi-4 (dense, Phi3ForCausalLM): the Llama decoder with fused qkv_proj and gate_up_proj
in the checkpoint, LongRoPE, a partial rotary (Phi-4-mini) and a sliding window where config.json sets one."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


def attention_features(cfg: dict) -> set[str]:
    """Every layer keeps config.json's one sliding_window, if it sets one."""
    return {"sliding_window"} if cfg.get("sliding_window") else set()


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    """Phi3ForCausalLM, with tensor and pipeline parallelism (the shared decoder's layers)."""
    target = "turnout_phi3.model:Phi3ForCausalLM"
    return [
        ModelArchitecture(
            "Phi3ForCausalLM", target, tensor_parallel=True, pipeline_parallel=True,
            attention_features=attention_features,
        )
    ]  # fmt: skip
