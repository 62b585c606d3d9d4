"""The model selector: the plugin architecture of the checkpoint's name that declares the parallelism
asked."""

from __future__ import annotations

from turnout.config import EngineConfig
from turnout.errors import SelectionError
from turnout.models.registry import ModelArchitecture
from turnout.plugins import PluginManager
from turnout.selection.choice import Candidate, Choice, choose, plugin_candidates


def model_candidates(pm: PluginManager, architecture: str, config: EngineConfig) -> list[Candidate]:
    """Every plugin's architectures; valid: the checkpoint's name, and declaring the parallelism asked."""

    def check(_: str, a: ModelArchitecture) -> list[str]:
        if a.name != architecture:
            return [f"checkpoint is {architecture}"]
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        return a.problems(tp, pp, config.enable_expert_parallel)

    return plugin_candidates(pm, "turnout_model_architectures", "model", check)


def select_model(pm: PluginManager, architecture: str, config: EngineConfig) -> Choice:
    """The architecture named architecture (the checkpoint's); an error naming the installed ones where no
    plugin provides it, or the reasons where none provides it for config's parallel sizes."""
    cands = model_candidates(pm, architecture, config)
    named = [c for c in cands if c.name == architecture]
    if named and not any(c.valid for c in named):  # provided, but not for these parallel settings
        raise SelectionError(f"model {architecture} ({named[0].plugin}): {'; '.join(named[0].reasons)}")
    if not named:
        installed = ", ".join(f"{c.name} ({c.plugin})" for c in cands if c.obj) or "none"
        raise SelectionError(
            f"model architecture '{architecture}' is not supported by any installed plugin; "
            f"installed: {installed}; install a model plugin that provides it (docs/writing-a-plugin.md)"
        )
    return choose("model", cands, architecture)
