"""A third-party model plugin: GPT-NeoX (Pythia). The class is imported only when a checkpoint needs it."""

import turnout
from turnout.models import ModelArchitecture


@turnout.hookimpl
def turnout_model_architectures():
    target = "turnout_example_model.model:GPTNeoXForCausalLM"
    return [ModelArchitecture("GPTNeoXForCausalLM", target, pipeline_parallel=False)]  # all layers, one stage
