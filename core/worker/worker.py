"""One rank: its device, its parallel state, its ModelRunner. Executors drive workers by method name."""

from __future__ import annotations

import gc
from typing import Any

import torch

from turnout.attention.kv_spec import KVCacheConfig, KVCacheSpec
from turnout.config import EngineConfig
from turnout.engine.scheduler import SchedulerOutput
from turnout.layers.moe import FusedMoE
from turnout.selection import Selection
from turnout.structured_outputs import GrammarOutput
from turnout.worker.model_runner import ModelRunner
from turnout.worker.outputs import AsyncModelRunnerOutput, ModelRunnerOutput


class Worker:
    """One rank: its device (cuda:local_rank, or the CPU) and its ModelRunner. Executors drive it by method
    name (call, collective_rpc): KV sizing and allocation once, then execute_model and sample_tokens each
    step."""

    def __init__(self, config: EngineConfig, selection: Selection, local_rank: int = 0) -> None:
        if selection.platform.is_cuda:
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(selection.apply(config), selection, self.device)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """This rank's attention layers' KV-cache specs, by layer index on this rank."""
        return self.runner.kv_cache_specs()

    def set_kv_cache_config(self, config: KVCacheConfig) -> None:
        """The model's KV-cache groups, over every pipeline stage (the engine's, from every stage's specs):
        before the KV cache is sized."""
        self.runner.set_kv_cache_config(config)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit on this rank: num_gpu_blocks_override, cpu_kv_cache_bytes on the CPU, or what
        gpu_memory_utilization leaves after a max-size dummy step. The engine takes the ranks' minimum."""
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks for this rank's layers, then capture the CUDA graphs over them."""
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs(num_blocks)

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on this rank, over all of its attention layers."""
        return self.runner.kv_bytes_per_block()

    def execute_model(self, out: SchedulerOutput) -> None:
        """Run the step's forward; its logits wait on the device for sample_tokens."""
        self.runner.execute_model(out)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample the rows of the step execute_model ran, a grammar_output's rows masked by its bitmask
        first; waits for the tokens on the host."""
        return self.runner.sample_tokens(grammar_output)

    def sample_tokens_async(self, grammar_output: GrammarOutput | None = None) -> AsyncModelRunnerOutput:
        """sample_tokens without waiting: get() on the result waits for the tokens, which stay on the device
        too, for the next step's placeholder inputs (async scheduling)."""
        return self.runner.sample_tokens_async(grammar_output)

    def memory_report(self) -> dict[str, Any]:
        """This rank's share, in bytes: weights (experts' also apart), KV cache and, on CUDA, the peak
        allocated; and every parameter's shape, which shows what was materialised here."""
        model = self.runner.model
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        experts = [p for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters()]
        report: dict[str, Any] = {
            "weight_bytes": nbytes(model.parameters()),
            "expert_weight_bytes": nbytes(experts),
            "kv_cache_bytes": nbytes(self.runner.kv_cache_tensors),
            "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
        }
        if self.device.type == "cuda":
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def shutdown(self) -> None:
        """Release the model, KV cache and graphs: once this returns, the device memory they held is free
        for another engine in this process."""
        self.runner = None
        gc.collect()  # the runner, its graphs and layers refer to each other
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The Worker method named `method`, called with args and kwargs (collective_rpc's way in)."""
        return getattr(self, method)(*args, **kwargs)
