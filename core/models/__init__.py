"""Model architectures: the registry entry a plugin returns, and the shared decoder they build on."""

from turnout.models.registry import ModelArchitecture

__all__ = ["DecoderForCausalLM", "ModelArchitecture"]


def __getattr__(name: str):
    # the decoder pulls in torch layers: a plugin's hook module imports ModelArchitecture alone, cheaply
    if name == "DecoderForCausalLM":
        from turnout.models.decoder import DecoderForCausalLM

        return DecoderForCausalLM
    raise AttributeError(name)
