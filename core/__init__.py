"""turnout: an LLM inference engine whose attention backends, models, executors and graph policies
are plugins, chosen at start-up with a reason for every choice."""

from turnout import plugins  # adds the plugins' switches to envs.registry(), wherever envs is used
from turnout.envs import EnvVar
from turnout.errors import TurnoutError
from turnout.hookspecs import hookimpl
from turnout.priority import Priority
from turnout.sampling_params import SamplingParams
from turnout.structured_outputs import StructuredOutputsParams
from turnout.version import PLUGIN_API
from turnout.version import __version__ as __version__

__all__ = [
    "LLM",
    "PLUGIN_API",
    "EngineConfig",
    "EnvVar",
    "Platform",
    "Priority",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TurnoutError",
    "cache_dir",
    "hookimpl",
]

# Imported on first use: LLM pulls in torch models and the engine; keep `import turnout` light for plugins
# and the CLI.
_LAZY = {
    "LLM": "turnout.llm",
    "RequestOutput": "turnout.outputs",
    "EngineConfig": "turnout.config",
    "Platform": "turnout.platform",
    "cache_dir": "turnout.loader.default_model",
}


def _misfit(hook: str, item: object) -> str | None:
    """turnout.plugin_shapes.misfit, imported when the first plugin is checked: the contracts import torch,
    and `import turnout` stays light."""
    from turnout.plugin_shapes import misfit

    return misfit(hook, item)


plugins.set_shape_check(_misfit)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
