"""A third-party model plugin: GPT-NeoX (Pythia). The class is imported only when a checkpoint needs it."""

import turnout
from turnout.models import ModelArchitecture


@turnout.hookimpl
def turnout_model_architectures():
    return [ModelArchitecture("GPTNeoXForCausalLM", "turnout_example_model.model:GPTNeoXForCausalLM")]
