"""select_all: the start-up selection as a list of steps. The tuning records are applied once, first;
then one selector per kind, each taking its inputs and returning its Choice; then what the choices imply:
the graph mode that runs, the settings fitted to the hardware, async scheduling and the experts' placement."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

from turnout.config import EngineConfig
from turnout.defaults import fit_defaults
from turnout.models.info import ModelInfo
from turnout.platform import Platform, current_platform
from turnout.plugins import PluginManager, get_plugin_manager
from turnout.selection.attention import select_attention
from turnout.selection.executor import resolve_async_scheduling, select_executor
from turnout.selection.graph import effective_graph, select_graph
from turnout.selection.measured import apply_records
from turnout.selection.model import select_model
from turnout.selection.moe import expert_placement, select_moe
from turnout.selection.quantization import kv_cache_dtype, quantization_notes, select_quantization
from turnout.selection.result import Selection

logger = logging.getLogger("turnout")


def select_all(
    config: EngineConfig, info: ModelInfo, pm: PluginManager | None = None, platform: Platform | None = None
) -> Selection:
    """Every choice for config and the checkpoint info describes, on platform (default: this machine's),
    among pm's plugins (default: the installed ones). A setting the matching tuning record decides counts
    as the config's for every step after apply_records."""
    info.check_parallel(config.tensor_parallel_size, config.pipeline_parallel_size)  # before any process
    pm = pm or get_plugin_manager()
    platform = platform or current_platform()
    dtype = info.resolve_dtype(config.dtype, platform)
    config, measured = apply_records(config, info, platform, pm)
    moe = select_moe(config, info, platform, dtype)  # first: a dense model's MoE settings say so
    quantization = select_quantization(pm, config, info, platform, dtype)
    requested_kv = config.kv_cache_dtype
    config, kv_note = kv_cache_dtype(config, quantization, info, platform, dtype)  # before attention
    if "kv_cache_dtype" in measured.settings:  # the user listed it for `turnout tune` to measure
        kv_note = "; ".join(filter(None, [f"tuned: measured, {measured.source}", kv_note]))
    model = select_model(pm, info.architecture, config)  # before attention: its layers' features
    attention = select_attention(pm, config, info, model.obj, platform, dtype)
    executor = select_executor(pm, config, platform)
    graph = select_graph(pm, config)
    moe_kernel = moe.obj if moe is not None else None
    effective, graph_note = effective_graph(graph, attention.obj, moe_kernel, config, platform)
    fitted = fit_defaults(config, platform, attention.obj)
    async_on, async_note = resolve_async_scheduling(config.async_scheduling, executor.obj, platform)
    if config.async_scheduling is None:
        fitted["async_scheduling"] = (async_on, async_note)
    if config.kv_cache_dtype != requested_kv:
        fitted["kv_cache_dtype"] = (config.kv_cache_dtype, kv_note)
    fitted |= measured.fitted()
    return Selection(
        platform, info, dtype, attention, model, executor, graph, effective, graph_note,
        fitted=fitted, moe=moe, quantization=quantization, measured=measured,
        quantization_notes=quantization_notes(quantization, config, info, platform, dtype),
        experts=expert_placement(config, info) if moe is not None else None,
        async_scheduling=async_on, async_scheduling_note=async_note, kv_cache_dtype=config.kv_cache_dtype,
        kv_cache_note=kv_note,
    )  # fmt: skip


def worker_handoff(
    selection: Selection, config: EngineConfig, dumps: Callable[[Any], bytes] | None = None
) -> tuple[EngineConfig, bytes | None]:
    """What a worker process needs to rebuild the driver's choices: the config with every choice pinned by
    name, and the Selection pickled (None where it does not pickle; the worker then selects again)."""
    pinned = config.model_copy(
        update={
            "model": str(selection.model_info.path),
            "tuned": "off",  # the driver's measured choices travel pinned below
            "attention_backend": selection.attention.chosen.name,
            "executor": selection.executor.chosen.name,
            "cudagraph_mode": selection.graph.chosen.name,
            **({"moe_kernel": selection.moe.chosen.name} if selection.moe else {}),
            **({"quantization": selection.quantization.chosen.name} if selection.quantization else {}),
        }
    )
    try:
        return pinned, (dumps or pickle.dumps)(selection)
    except Exception as e:
        logger.info("selection does not pickle (%s); workers select again", e)
        return pinned, None


def selection_from_payload(config: EngineConfig, payload: bytes | None) -> Selection:
    """In a worker process: the driver's pickled Selection, or, where it did not travel, the same choices
    made again (the executor pins them by name in config)."""
    if payload is not None:
        try:
            return pickle.loads(payload)
        except Exception as e:
            logger.warning("selection did not unpickle (%s: %s); selecting again", type(e).__name__, e)
    assert config.model is not None
    return select_all(config, ModelInfo.from_dir(config.model))
