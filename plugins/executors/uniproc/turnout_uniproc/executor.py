from __future__ import annotations

from typing import Any

from turnout import EngineConfig
from turnout.executor import (
    AsyncModelRunnerOutput,
    Executor,
    ModelRunnerOutput,
    SchedulerOutput,
    Selection,
    Worker,
)


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.worker = Worker(config, selection)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        return self.worker.sample_tokens(grammar_output)

    def step_async(self, scheduler_output: SchedulerOutput, grammar: Any = None) -> AsyncModelRunnerOutput:
        self.worker.execute_model(scheduler_output)
        return self.worker.sample_tokens_async(grammar() if grammar is not None else None)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [self.worker.call(method, *args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker.shutdown()
