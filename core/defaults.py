"""Settings left unset (None) are fitted to the hardware and the chosen backend here, each with the reason
`turnout explain` prints. A value the user set is kept as it is."""

from __future__ import annotations

from typing import Any

from turnout.attention.backend import AttentionBackend
from turnout.config import EngineConfig
from turnout.platform import Platform

LARGE_GPU_BYTES = 70 * 2**30


def fit_defaults(
    config: EngineConfig, platform: Platform, backend: AttentionBackend
) -> dict[str, tuple[Any, str]]:
    """{field: (value, why)} for every fitted field that config leaves as None."""
    fitted: dict[str, tuple[Any, str]] = {}
    if config.block_size is None:
        fitted["block_size"] = (backend.preferred_block_size, f"{backend.name}'s preferred KV block size")
    if config.max_num_batched_tokens is None:
        fitted["max_num_batched_tokens"] = _token_budget(platform)
    return fitted


def _token_budget(platform: Platform) -> tuple[int, str]:
    # vLLM's offline defaults: large steps keep a big GPU busy; on the CPU vLLM's offline 4096, where a
    # 4k-token prompt is one prefill step (8.2 s against 8.6 s in two steps of 2048 on two cores).
    if not platform.is_cuda:
        return 4096, "CPU: vLLM's offline default"
    gib = platform.total_memory / 2**30
    if platform.total_memory >= LARGE_GPU_BYTES:
        return 16384, f"GPU with {gib:.0f} GiB (>= 70): large prefill steps"
    return 8192, f"GPU with {gib:.0f} GiB (< 70)"
