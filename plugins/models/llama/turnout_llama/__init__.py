"""Llama-family models: SmolLM2, Llama 2 and Llama 3.x (llama3 rope scaling); Mistral has its own plugin."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    return [ModelArchitecture("LlamaForCausalLM", "turnout_llama.model:LlamaForCausalLM")]
