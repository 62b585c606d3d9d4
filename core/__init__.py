"""turnout: an LLM inference engine whose attention backends, models, executors and graph policies
are plugins, chosen at start-up with a reason for every choice."""

from turnout.errors import TurnoutError
from turnout.hookspecs import hookimpl
from turnout.sampling_params import SamplingParams

__all__ = ["LLM", "Platform", "RequestOutput", "SamplingParams", "TurnoutError", "hookimpl"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch models and the engine, Platform torch; keep `import turnout` light for the CLI.
    if name in ("LLM", "RequestOutput"):
        from turnout import llm

        return getattr(llm, name)
    if name == "Platform":
        from turnout.platform import Platform

        return Platform
    raise AttributeError(name)
