from __future__ import annotations

from typing import Any

from turnout.config import EngineConfig
from turnout.engine.scheduler import SchedulerOutput
from turnout.executor import Executor
from turnout.selection import Selection
from turnout.worker.model_runner import AsyncModelRunnerOutput, ModelRunnerOutput
from turnout.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.worker = Worker(config, selection)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.worker.sample_tokens()

    def step_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        self.worker.execute_model(scheduler_output)
        return self.worker.sample_tokens_async()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [self.worker.call(method, *args, **(kwargs or {}))]
