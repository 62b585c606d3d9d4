"""Executors run the model on one or more workers and hand back sampled tokens."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turnout.platform import Platform
from turnout.priority import Priority

if TYPE_CHECKING:
    from turnout.engine.scheduler import SchedulerOutput
    from turnout.structured_outputs import GrammarOutput
    from turnout.worker.outputs import AsyncModelRunnerOutput, ModelRunnerOutput


@dataclass(frozen=True)
class ExecutorContext:
    """What an executor's check(ctx) judges: the platform, the ranks one engine replica needs, whether the
    user named this executor, and whether the ranks must run in processes of their own."""

    platform: Platform
    world_size: int  # tensor_parallel_size * pipeline_parallel_size
    explicit: bool  # the user named this executor
    own_processes: bool = False  # ranks must run outside the engine's process (data parallelism on CUDA)


def _no_reasons(ctx: ExecutorContext) -> list[str]:
    """check(ctx): every reason this executor cannot run ctx (world size, platform, processes of its own),
    each naming the fix; empty where it can. The default finds none."""
    return []


@dataclass(frozen=True)
class ExecutorSpec:
    """An executor a plugin offers (`turnout_executors`): its name, priority tier and class (`target`,
    imported only when chosen), check(ctx) for why it cannot serve, and what its class supports."""

    name: str
    target: str  # "package.module:ExecutorClass", imported only when chosen
    priority: int = Priority.DEFAULT
    check: Callable[[ExecutorContext], list[str]] = field(default=_no_reasons)
    # The model runs in the engine's own process. False: the ranks live in processes of their own, so a
    # DataParallelEngine may step this executor in a thread, and it can serve data parallelism on CUDA
    # (each replica's processes see only that replica's GPUs).
    in_process: bool = True
    supports_async_scheduling: bool = False  # the executor implements step_async

    def load(self) -> type[Executor]:
        """The Executor class `target` names, imported now."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


class Executor:
    """Implementations: __init__(config, selection) builds the workers; the engine then sizes and allocates
    their KV caches through collective_rpc."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward for this step; logits stay on the workers until sample_tokens."""
        raise NotImplementedError

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample the rows of the step execute_model ran, first masking a grammar_output's rows with its
        bitmask (structured outputs); pass it on to the workers as it is."""
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call method on every worker; one result per worker."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        """Stop the workers and release what they hold (processes, actors, device memory); safe to call
        any number of times."""

    def step(
        self,
        scheduler_output: SchedulerOutput,
        grammar: Callable[[], GrammarOutput | None] | None = None,
    ) -> ModelRunnerOutput:
        """execute_model, then sample_tokens; grammar() makes the bitmask on the host as the forward runs."""
        self.execute_model(scheduler_output)
        return self.sample_tokens(grammar() if grammar is not None else None)

    def step_async(
        self,
        scheduler_output: SchedulerOutput,
        grammar: Callable[[], GrammarOutput | None] | None = None,
    ) -> AsyncModelRunnerOutput:
        """Launch the forward and the sampling and return at once; the result's get() waits for the sampled
        tokens alone. grammar(), where given, is called once the forward is launched and before the
        sampling, whose rows its GrammarOutput masks (it may wait for the step before: the forward runs
        meanwhile). Executors whose spec sets supports_async_scheduling implement it."""
        raise NotImplementedError
