"""One rank: its device, its parallel state, its ModelRunner. Executors drive workers by method name."""

from __future__ import annotations

from typing import Any

import torch

from turnout.config import EngineConfig
from turnout.engine.scheduler import SchedulerOutput
from turnout.selection import Selection
from turnout.worker.model_runner import ModelRunner, ModelRunnerOutput


class Worker:
    def __init__(self, config: EngineConfig, selection: Selection, local_rank: int = 0) -> None:
        if selection.platform.is_cuda:
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(selection.apply(config), selection, self.device)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs(num_blocks)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def execute_model(self, out: SchedulerOutput) -> None:
        self.runner.execute_model(out)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.runner.sample_tokens()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)
