"""Every turnout hook spec. Plugins implement them with `@turnout.hookimpl`.

Lifecycle: specs are called once at engine start-up, during selection. The core calls each plugin's
implementation separately, so every candidate is tagged with the plugin that offered it; one plugin
raising does not hide the others. Results of all plugins are concatenated into one candidate list,
and selection (turnout.selection) picks from it and explains every rejection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from turnout.attention.backend import AttentionBackend
    from turnout.executor.base import ExecutorSpec
    from turnout.graphs.modes import GraphPolicy
    from turnout.models.registry import ModelArchitecture
    from turnout.platform import Platform

PROJECT = "turnout"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    """Attention backends this plugin offers on `platform`.

    Combine: all plugins' lists are concatenated. Return backends even when their kernel library is
    missing: `check()` turns the ImportError into a reason, so users see why a backend is not chosen.
    The highest-priority backend whose `check()` is empty wins unless the config names one.
    """


@hookspec
def turnout_model_architectures() -> list[ModelArchitecture]:
    """Model classes keyed by the HF `architectures` name in a checkpoint's config.json.

    Combine: concatenated; for one architecture name, the highest priority wins, ties by plugin name.
    """


@hookspec
def turnout_executors() -> list[ExecutorSpec]:
    """Executors (how workers are started and driven).

    Combine: concatenated; among executors whose `check()` is empty, the highest priority wins
    unless the config names one.
    """


@hookspec
def turnout_graph_policies() -> list[GraphPolicy]:
    """CUDA-graph policies, selected by name through `cudagraph_mode`.

    Combine: concatenated; names must be unique, and a later duplicate is rejected with a reason.
    The chosen policy is then downgraded to what the attention backend supports.
    """
