"""Mistral (Mistral 7B v0.1-v0.3, Mistral NeMo, Ministral): the Llama decoder, with every layer attending
within config.json's sliding_window where it sets one."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


def attention_features(cfg: dict) -> set[str]:
    """Every layer keeps the one window of config.json, if it sets one."""
    return {"sliding_window"} if cfg.get("sliding_window") else set()


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    target = "turnout_mistral.model:MistralForCausalLM"
    return [ModelArchitecture("MistralForCausalLM", target, attention_features=attention_features)]
