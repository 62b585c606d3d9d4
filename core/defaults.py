"""Settings left unset (None) are fitted to the hardware and the chosen backend here, each with the reason
`turnout explain` prints. A value the user set is kept as it is."""

from __future__ import annotations

from typing import Any

from turnout.attention.backend import AttentionBackend
from turnout.attention.per_phase import PerPhaseBackend
from turnout.config import EngineConfig
from turnout.platform import Platform

LARGE_GPU_BYTES = 70 * 2**30


def fit_defaults(
    config: EngineConfig, platform: Platform, backend: AttentionBackend
) -> dict[str, tuple[Any, str]]:
    """{field: (value, why)} for every fitted field that config leaves as None."""
    fitted: dict[str, tuple[Any, str]] = {}
    if config.block_size is None:
        fitted["block_size"] = _block_size(backend)
    if config.max_num_batched_tokens is None:
        fitted["max_num_batched_tokens"] = _token_budget(platform)
    if config.max_num_seqs is None:
        tokens = config.max_num_batched_tokens or fitted["max_num_batched_tokens"][0]
        fitted["max_num_seqs"] = _max_num_seqs(platform, tokens, config.num_gpu_blocks_override)
    return fitted


def _block_size(backend: AttentionBackend) -> tuple[int, str]:
    """The backend's preferred block size; for a decode+mixed pair, which half's it is (pair_block_size)."""
    size = backend.preferred_block_size
    if not isinstance(backend, PerPhaseBackend):
        return size, f"{backend.name}'s preferred KV block size"
    phase = backend.block_size_phase
    if phase is None:
        return size, f"{backend.name}: the smallest KV block size both halves take"
    half = dict(backend.halves())[phase].name
    return size, f"{backend.name}: the {phase} half {half}'s preferred KV block size, which both take"


def _device(platform: Platform) -> str:
    if not platform.is_cuda:
        return "CPU"
    gib = platform.total_memory / 2**30
    return f"GPU with {gib:.0f} GiB ({'>=' if platform.total_memory >= LARGE_GPU_BYTES else '<'} 70)"


def _token_budget(platform: Platform) -> tuple[int, str]:
    # vLLM's offline defaults: large steps keep a big GPU busy; on the CPU vLLM's offline 4096, where a
    # 4k-token prompt is one prefill step (8.2 s against 8.6 s in two steps of 2048 on two cores).
    if not platform.is_cuda:
        return 4096, "CPU: vLLM's offline default"
    if platform.total_memory >= LARGE_GPU_BYTES:
        return 16384, f"{_device(platform)}: large prefill steps"
    return 8192, _device(platform)


def _max_num_seqs(platform: Platform, max_num_batched_tokens: int, num_blocks: int | None) -> tuple[int, str]:
    """vLLM's offline LLM: 1024 running requests on a GPU of 70 GiB or more, 256 on a smaller one and on
    the CPU (vLLM's 256 a rank; turnout keeps 256 at any world size, as it keeps the CPU's 4096 tokens).
    Never more than a step's tokens (vLLM caps it so), nor than a fixed KV cache's blocks
    (num_gpu_blocks_override): each running request holds a block of its own. A cache sized from memory
    is known only once the weights are loaded, and the scheduler admits a request only while blocks are
    free, so running requests stay within it anyway. The default capture sizes reach max_num_seqs
    (default_capture_sizes), so a decode step of every running request replays a graph."""
    seqs = 1024 if platform.is_cuda and platform.total_memory >= LARGE_GPU_BYTES else 256
    why = f"{_device(platform)}: vLLM's offline default {seqs}"
    caps = (
        (max_num_batched_tokens, "max_num_batched_tokens", "no more requests than a step's tokens"),
        (num_blocks, "num_gpu_blocks_override", "each running request holds a KV block"),
    )
    for cap, name, because in caps:
        if cap is not None and cap < seqs:
            seqs, why = cap, f"{why}, capped at {name} {cap} ({because})"
    return seqs, why
