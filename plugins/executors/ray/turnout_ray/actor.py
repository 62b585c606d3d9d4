"""One rank inside a Ray actor: the core's RankWorker behind Ray's remote calls.

Ray runs a (synchronous) actor's calls one at a time, in the order one caller sent them, so execute_model
and the sample_tokens after it reach the Worker in that order."""

from __future__ import annotations

import os
from typing import Any

import ray

from turnout.executor import ModelRunnerOutput, RankInfo, RankWorker, SchedulerOutput, free_port


class RankActor:
    """Wrapped by ray.remote in the driver; a plain class so it imports without a Ray cluster."""

    def __init__(self) -> None:
        self.rank: RankWorker | None = None

    def node(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        return free_port("")  # rank 0's node hosts the rendezvous; other nodes reach it by its IP

    def start(self, info: RankInfo) -> None:
        self.rank = RankWorker(info)  # info.local_rank is 0: Ray shows this actor its own GPU only

    def execute_model(self, out: SchedulerOutput) -> None:
        self._rank().execute_model(out)

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput | None:
        return self._rank().sample_tokens(grammar_output)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return self._rank().call(method, *args, **kwargs)

    def ping(self) -> int:
        return os.getpid()

    def _rank(self) -> RankWorker:
        if self.rank is None:
            raise RuntimeError("this rank was not started")
        return self.rank
