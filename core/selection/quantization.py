"""The quantization selector: the method that reads the checkpoint's quantization_config, or the online
method `quantization` names; a quantized checkpoint never loads as if it were not."""

from __future__ import annotations

import torch

from turnout.config import EngineConfig
from turnout.errors import ConfigError, SelectionError
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.plugins import PluginManager
from turnout.quantization import KNOWN_FORMATS, QuantizationContext, kv_cache_dtype_for
from turnout.selection.choice import Choice, choose, plugin_candidates


def quantization_context(
    config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> QuantizationContext:
    """What the quantization methods are checked against; a quantization_config that is not a table is
    refused here."""
    qc = info.hf_config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{info.path}/config.json: quantization_config is not an object; fix config.json")
    return QuantizationContext(
        platform, qc, config.quantization, dtype, info.hf_config, config.tensor_parallel_size
    )


def select_quantization(
    pm: PluginManager, config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> Choice | None:
    """None where the checkpoint has no quantization_config and `quantization` is unset. Otherwise the
    checkpoint's format (or the online method `quantization` names) must have a valid method, or start-up
    stops with one line: a quantized checkpoint never loads as if it were not."""
    ctx = quantization_context(config, info, platform, dtype)
    if ctx.quant_config is None and ctx.requested is None:
        return None
    check = lambda _, m: m.check(ctx)
    cands = plugin_candidates(pm, "turnout_quantization_methods", "quantization", check, platform=platform)
    fmt = ctx.quant_method
    if fmt is not None:
        readers = [c for c in cands if c.obj is not None and fmt in c.obj.checkpoint_formats]
        if not readers:
            serves = KNOWN_FORMATS.get(fmt)
            hint = f"install {serves}" if serves else "no known turnout plugin serves it; convert the model"
            installed = ", ".join(c.name for c in cands) or "none"
            raise SelectionError(
                f"checkpoint {info.path} is quantized with quant_method '{fmt}' (config.json "
                f"quantization_config), which no installed quantization method reads (installed: "
                f"{installed}); {hint}"
            )
        if ctx.requested is not None and not any(c.name == ctx.requested for c in readers):
            raise ConfigError(
                f"quantization = {ctx.requested}, but checkpoint {info.path} is quantized with quant_method "
                f"'{fmt}', which {', '.join(c.name for c in readers)} reads; unset quantization"
            )
        if not any(c.valid for c in readers):
            why = "; ".join(f"{c.name}: {', '.join(c.reasons)}" for c in readers)
            raise SelectionError(
                f"checkpoint {info.path} (quant_method '{fmt}') cannot be served here: {why}"
            )
    return choose("quantization", cands, ctx.requested or "auto")


def quantization_notes(
    choice: Choice | None, config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> list[str]:
    """The chosen method's account of how each layer kind it replaces computes here (its `notes`)."""
    if choice is None:
        return []
    return list(choice.obj.notes(quantization_context(config, info, platform, dtype)))


def kv_cache_dtype(
    config: EngineConfig, choice: Choice | None, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> tuple[EngineConfig, str]:
    """config with the KV cache dtype the checkpoint's quantization asks for (a checkpoint with FP8 KV
    cache scales: fp8 where kv_cache_dtype is auto), and why, in words ("" where config's stands as set)."""
    if choice is None:
        return config, ""
    ctx = quantization_context(config, info, platform, dtype)
    kv, why = kv_cache_dtype_for(config.kv_cache_dtype, choice.obj, ctx)
    return config.model_copy(update={"kv_cache_dtype": kv}), why
