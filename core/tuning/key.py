"""The key of a tuning record: everything that can change which configuration measures fastest. A record
whose key differs from the current one in any field is not used."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import re
from pathlib import Path
from typing import Any

import torch

from turnout.attention.backend import kv_cache_torch_dtype
from turnout.config import EngineConfig
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.plugins import PluginManager

PROFILES = ("throughput", "latency", "prefix")
CORE_DIST = (
    "turnout"  # its requirements (transformers, pydantic, ...) do not pick kernels; torch is keyed apart
)
_MISSING = object()


def tuning_key(
    config: EngineConfig, info: ModelInfo, platform: Platform, pm: PluginManager, workload: str
) -> dict[str, Any]:
    """The record key of this machine, software, model, parallel layout and workload profile (JSON-able).
    An FP8 KV cache adds model.kv_cache_dtype, so records measured with the model-dtype cache (whose keys
    lack it) do not decide for it."""
    dtype = info.resolve_dtype(config.dtype, platform)
    kv = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    cache = {"kv_cache_dtype": str(kv).removeprefix("torch.")} if kv != dtype else {}
    return {
        "device": {"gpu": platform.device_name, "gpu_count": platform.device_count},
        "versions": {**software_versions(platform), **plugin_versions(pm)},
        "model": {**model_shape(info, dtype), **cache},
        "parallel": {
            "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size,
            "data_parallel_size": config.data_parallel_size,
        },
        "workload": workload_profile(workload),
    }


def key_diff(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each field where the keys differ, in words ("torch 2.11 -> 2.12", "model hidden_size 576 -> 1024");
    empty when they match."""
    out = []
    for section in dict.fromkeys([*recorded, *current]):
        old, new = recorded.get(section, _MISSING), current.get(section, _MISSING)
        if isinstance(old, dict) and isinstance(new, dict):
            prefix = "model " if section == "model" else ""
            for k in dict.fromkeys([*old, *new]):
                if (a := old.get(k, _MISSING)) != (b := new.get(k, _MISSING)):
                    out.append(_change(prefix + k, a, b))
        elif old != new:
            out.append(_change(section, old, new))
    return out


def _change(name: str, old: Any, new: Any) -> str:
    if old is _MISSING:
        return f"{name} {_text(new)} added"
    if new is _MISSING:
        return f"{name} {_text(old)} removed"
    return f"{name} {_text(old)} -> {_text(new)}"


def _text(v: Any) -> str:
    return "none" if v is None else str(v)


def model_shape(info: ModelInfo, dtype: torch.dtype) -> dict[str, Any]:
    """What of the model decides the kernels' shapes and costs."""
    cfg = info.hf_config
    return {
        "architecture": info.architecture,
        "hidden_size": cfg.get("hidden_size"),
        "intermediate_size": cfg.get("intermediate_size"),
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_dim": info.head_size,
        "vocab_size": cfg.get("vocab_size"),
        "dtype": str(dtype).removeprefix("torch."),
    }


def software_versions(platform: Platform) -> dict[str, str | None]:
    """torch, its CUDA and the NVIDIA driver (None off CUDA)."""
    cuda = platform.is_cuda
    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "driver": _driver(cuda)}


def plugin_versions(pm: PluginManager) -> dict[str, str]:
    """Every loaded plugin's distribution and version, and the installed libraries each requires (the
    kernels it runs: triton, flashinfer-python, flash-attn); an in-process plugin is keyed by its name."""
    out: dict[str, str] = {}
    for p in pm.listing():
        if p.status != "loaded":
            continue
        installed = p.distribution not in ("(in-process)", "?")
        out[p.distribution if installed else f"plugin {p.name}"] = p.version
        if installed and p.distribution != CORE_DIST:
            out.update(_requirements(p.distribution, p.version))
    return out


@functools.cache
def _requirements(dist: str, version: str) -> dict[str, str]:
    """{name: version} of dist's requirements that are installed (turnout itself left out)."""
    out = {}
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:  # registered in-process under a distribution's name
        return out
    for req in reqs:
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if name and name.group() != CORE_DIST:
            try:
                out[name.group()] = md.version(name.group())
            except md.PackageNotFoundError:
                pass
    return out


@functools.cache
def _driver(cuda: bool) -> str | None:
    """The NVIDIA kernel driver's version, from /proc, else NVML; None off CUDA or where neither answers."""
    if not cuda:
        return None
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        if m := re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", text):
            return m.group(1)
    except OSError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no NVML: the key says so rather than guessing
        return None


def workload_profile(workload: str) -> str:
    """A profile name as it is, or a JSONL file as its name and the hash of its contents (so an edited file
    is another workload)."""
    path = Path(workload)
    if workload in PROFILES or not path.is_file():
        return workload
    return f"{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
