"""The executor contract: one interface for uniproc, multiproc and Ray (the engine never sees the world size),
and the rank bootstrap multi-process executors share (`turnout.executor.rank`)."""

from turnout.executor.base import Executor, ExecutorContext, ExecutorSpec
from turnout.executor.rank import (
    RankInfo,
    RankWorker,
    cpu_cores,
    exit_with_parent,
    free_port,
    output_rank,
    plan_ranks,
)

__all__ = [
    "AsyncModelRunnerOutput",
    "Executor",
    "ExecutorContext",
    "ExecutorSpec",
    "ModelRunnerOutput",
    "RankInfo",
    "RankWorker",
    "SchedulerOutput",
    "Selection",
    "Worker",
    "cpu_cores",
    "exit_with_parent",
    "free_port",
    "output_rank",
    "plan_ranks",
]

# The types an executor's methods take and return, imported on first use (they pull in the engine).
_LAZY = {
    "AsyncModelRunnerOutput": "turnout.worker.outputs",
    "ModelRunnerOutput": "turnout.worker.outputs",
    "SchedulerOutput": "turnout.engine.scheduler",
    "Selection": "turnout.selection",
    "Worker": "turnout.worker.worker",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
