"""Mixtral (8x7B, 8x22B): the Mistral decoder with a sparse mixture-of-experts block in every layer."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


def attention_features(cfg: dict) -> set[str]:
    """Every layer keeps the one window of config.json, if it sets one."""
    return {"sliding_window"} if cfg.get("sliding_window") else set()


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    target = "turnout_mixtral.model:MixtralForCausalLM"
    return [
        ModelArchitecture(
            "MixtralForCausalLM", target, expert_parallel=True, attention_features=attention_features
        )
    ]
