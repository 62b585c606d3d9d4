"""The executor interface: one for uniproc, multiproc and Ray; the engine never sees the world size."""

from turnout.executor.base import Executor, ExecutorContext, ExecutorSpec, RankInfo

__all__ = ["Executor", "ExecutorContext", "ExecutorSpec", "RankInfo"]
