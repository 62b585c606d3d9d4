"""The graph selector, and the graph mode as it runs: the policy requested, downgraded to what the chosen
attention backend, the device and a MoE model's kernel allow."""

from __future__ import annotations

import logging

from turnout.attention.backend import AttentionBackend
from turnout.config import EngineConfig
from turnout.graphs.modes import EAGER, GraphPolicy, downgrade
from turnout.layers.moe import MoEKernel, graph_blocker
from turnout.platform import Platform
from turnout.plugins import PluginManager
from turnout.selection.choice import Candidate, Choice, choose, plugin_candidates

logger = logging.getLogger("turnout")


def graph_candidates(pm: PluginManager) -> list[Candidate]:
    """Every plugin's graph policies; a name another plugin registered first is invalid."""
    seen: dict[str, str] = {}  # policy name -> the plugin that registered it first

    def unique(plugin: str, p: GraphPolicy) -> list[str]:
        if p.name in seen:
            return [f"name already registered by plugin {seen[p.name]}"]
        seen[p.name] = plugin
        return []

    return plugin_candidates(pm, "turnout_graph_policies", "graph", unique)


def select_graph(pm: PluginManager, config: EngineConfig) -> Choice:
    """The graph policy config.cudagraph_mode names, as requested (effective_graph gives the one that
    runs)."""
    return choose("graph", graph_candidates(pm), config.cudagraph_mode)


def effective_graph(
    graph: Choice,
    backend: AttentionBackend,
    moe: MoEKernel | None,
    config: EngineConfig,
    platform: Platform,
) -> tuple[GraphPolicy, str | None]:
    """The policy that runs, and why it differs from graph's (None where it does not): downgraded to
    backend's CUDA-graph support (vLLM's rules), to NONE on the CPU or with enforce_eager, to NONE under
    pipeline parallelism (a stage's step is split by the sends between stages), and to NONE where the MoE
    kernel moe cannot run in a graph."""
    effective, note = downgrade(
        graph.obj, backend.cudagraph_support, backend.name, platform.device_type, config.enforce_eager
    )
    if moe is not None and effective.uses_graphs and (why := graph_blocker(moe, config.expert_parallel_size)):
        effective, note = EAGER, why
    if effective.uses_graphs and config.pipeline_parallel_size > 1:
        effective, note = EAGER, f"pipeline_parallel_size {config.pipeline_parallel_size}: stages run eager"
    if note:  # worth a warning only where graphs could have run; on CPU they never do (explain shows it)
        level = logging.WARNING if platform.is_cuda and not config.enforce_eager else logging.INFO
        level = level if platform.is_cuda else logging.DEBUG
        logger.log(level, "cudagraph_mode %s -> %s: %s", graph.chosen.name, effective.name, note)
    return effective, note
