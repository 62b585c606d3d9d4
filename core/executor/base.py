"""Executors run the model on one or more workers and hand back sampled tokens."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turnout.platform import Platform

if TYPE_CHECKING:
    from turnout.engine.scheduler import SchedulerOutput
    from turnout.worker.model_runner import AsyncModelRunnerOutput, ModelRunnerOutput


@dataclass(frozen=True)
class ExecutorContext:
    platform: Platform
    world_size: int  # tensor_parallel_size * pipeline_parallel_size
    explicit: bool  # the user named this executor


@dataclass(frozen=True)
class RankInfo:
    """What one worker process of a multi-process executor needs to join the others."""

    rank: int  # pp_rank * tp_size + tp_rank
    world_size: int
    tp_size: int
    init_method: str  # tcp://<host>:<port>, picked free by the driver
    output_rank: int  # the rank whose sampled tokens travel back: first TP rank of the last stage
    threads: int  # torch CPU threads of this process
    log_level: int


@dataclass(frozen=True)
class ExecutorSpec:
    name: str
    target: str  # "package.module:ExecutorClass", imported only when chosen
    priority: int = 0
    check: Callable[[ExecutorContext], list[str]] = field(default=lambda ctx: [])
    supports_async_scheduling: bool = False  # the executor implements step_async

    def load(self) -> type[Executor]:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


class Executor:
    """Implementations: __init__(config, selection) builds the workers and their KV caches."""

    num_blocks: int
    in_process: bool = (
        True  # False: the model runs in other processes (DataParallelEngine steps it in a thread)
    )

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward for this step; logits stay on the workers until sample_tokens."""
        raise NotImplementedError

    def sample_tokens(self) -> ModelRunnerOutput:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call method on every worker; one result per worker."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_model(scheduler_output)
        return self.sample_tokens()

    def step_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch the forward and the sampling and return at once; the result's get() waits for the sampled
        tokens alone. Executors whose spec sets supports_async_scheduling implement it."""
        raise NotImplementedError
