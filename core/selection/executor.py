"""The executor selector, and async scheduling as the chosen executor allows it."""

from __future__ import annotations

from turnout.config import EngineConfig
from turnout.errors import ConfigError
from turnout.executor.base import ExecutorContext, ExecutorSpec
from turnout.platform import Platform
from turnout.plugins import PluginManager
from turnout.selection.choice import Candidate, Choice, choose, plugin_candidates

OWN_PROCESSES = (  # the reason an in-process executor gets where each replica needs processes of its own
    "runs the model in the engine's process, but data_parallel_size > 1 on CUDA needs each replica's "
    "ranks in processes of their own"
)


def executor_candidates(pm: PluginManager, ctx: ExecutorContext) -> list[Candidate]:
    """Every plugin's executors, each with the reasons its check(ctx) gives, and OWN_PROCESSES for one that
    runs in the engine's process where ctx needs processes of their own."""

    def check(_: str, e: ExecutorSpec) -> list[str]:
        if ctx.own_processes and e.in_process:
            return [OWN_PROCESSES, *e.check(ctx)]
        return e.check(ctx)

    return plugin_candidates(pm, "turnout_executors", "executor", check)


def select_executor(pm: PluginManager, config: EngineConfig, platform: Platform) -> Choice:
    """config.executor among those that serve its world size. Data parallelism on CUDA gives each replica
    its own GPUs through CUDA_VISIBLE_DEVICES while its processes start: only an executor whose ranks run
    outside the engine's process (in_process=False) can."""
    own = config.data_parallel_size > 1 and platform.is_cuda
    ctx = ExecutorContext(platform, config.world_size, config.executor != "auto", own)
    return choose("executor", executor_candidates(pm, ctx), config.executor)


def resolve_async_scheduling(
    requested: bool | None, spec: ExecutorSpec, platform: Platform
) -> tuple[bool, str]:
    """async_scheduling as it will run, and why. Unset, it is on with CUDA where the executor supports it
    (nano-vllm's bench on an H200: docs/performance.md), and off on the CPU, where the forward runs in the
    host thread and leaves nothing to overlap."""
    if not spec.supports_async_scheduling:
        if requested:
            raise ConfigError(
                f"async_scheduling is on, but executor {spec.name} does not support it (uniproc, for one "
                "rank, does); set async_scheduling false or leave it unset"
            )
        return False, f"off: executor {spec.name} does not support it"
    if requested is not None:
        return requested, "on: set by the user" if requested else "off: set by the user"
    if not platform.is_cuda:
        return False, f"off: on {platform.device_type} the forward runs in the host thread"
    return True, f"on: executor {spec.name} supports it, with CUDA (--no-async-scheduling)"
