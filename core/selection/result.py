"""Selection: everything chosen at start-up, and why; what explain prints and the engine builds from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from turnout.attention.backend import AttentionBackend, kv_cache_torch_dtype
from turnout.config import EngineConfig
from turnout.executor.base import ExecutorSpec
from turnout.graphs.modes import GraphPolicy
from turnout.layers.moe import MoEKernel
from turnout.models.info import ModelInfo
from turnout.models.registry import ModelArchitecture
from turnout.platform import Platform
from turnout.selection.choice import Choice
from turnout.selection.measured import MeasuredTier


@dataclass
class Selection:
    """Everything chosen at start-up, and why. Each component is a Choice (its candidates, the chosen one
    and why the others lost): attention, model, executor, graph and, for MoE models, moe. The chosen
    objects sit behind accessors named for what they are: attention_backend, model_architecture,
    executor_spec, graph_policy (as requested), effective_graph (as it runs, after any downgrade) and
    moe_kernel."""

    platform: Platform
    model_info: ModelInfo
    dtype: torch.dtype
    attention: Choice
    model: Choice
    executor: Choice
    graph: Choice
    effective_graph: GraphPolicy
    graph_note: str | None = None
    notes: list[str] = field(default_factory=list)
    async_scheduling: bool = False  # as it runs: step N+1 is scheduled while step N is on the device
    async_scheduling_note: str = ""  # why it is on or off
    fitted: dict[str, tuple[Any, str]] = field(default_factory=dict)  # turnout.defaults: (value, why)
    moe: Choice | None = None  # MoE models only
    quantization: Choice | None = None  # a quantized checkpoint, or `quantization` set
    quantization_notes: list[str] = field(default_factory=list)  # how its layers compute (method.notes)
    experts: dict[str, Any] | None = None  # MoE models: the experts each rank holds (describe_placement)
    measured: MeasuredTier | None = None  # the tuning record read, and its decision
    kv_cache_dtype: str = "auto"  # as it runs, a KV_CACHE_DTYPES name; kv_cache_torch_dtype: its dtype
    kv_cache_note: str = ""  # why it is not the one configured, or where its scales come from

    def apply(self, config: EngineConfig) -> EngineConfig:
        """config with every setting it left unset replaced by its fitted value."""
        return config.model_copy(update={k: v for k, (v, _) in self.fitted.items()})

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element dtype: the model dtype, or float8_e4m3fn for kv_cache_dtype fp8."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    def kv_cache_description(self) -> str:
        """The KV cache dtype in words: "bfloat16", or "float8_e4m3fn (kv_cache_dtype fp8)", with
        kv_cache_note where there is one: "float8_e4m3fn (kv_cache_dtype fp8: auto: the checkpoint's ...)"."""
        name = str(self.kv_cache_torch_dtype).removeprefix("torch.")
        if self.kv_cache_dtype == "auto":
            return name
        note = f": {self.kv_cache_note}" if self.kv_cache_note else ""
        return f"{name} (kv_cache_dtype {self.kv_cache_dtype}{note})"

    @property
    def attention_backend(self) -> AttentionBackend:
        """The chosen attention backend (a PerPhaseBackend where one serves each phase)."""
        return self.attention.obj

    @property
    def model_architecture(self) -> ModelArchitecture:
        """The chosen model architecture: its name, and the class it loads."""
        return self.model.obj

    @property
    def executor_spec(self) -> ExecutorSpec:
        """The chosen executor's spec: its name, what it supports, and the class it loads."""
        return self.executor.obj

    @property
    def graph_policy(self) -> GraphPolicy:
        """The graph policy as requested; effective_graph is the one that runs."""
        return self.graph.obj

    @property
    def quantization_method(self) -> Any:
        """The chosen turnout.quantization.QuantizationMethod, or None: the weights load as they are."""
        return self.quantization.obj if self.quantization else None

    @property
    def moe_kernel(self) -> MoEKernel | None:
        """The chosen MoE kernel, or None for a model without experts."""
        return self.moe.obj if self.moe else None

    @property
    def backend(self) -> AttentionBackend:
        """attention_backend, by its short name."""
        return self.attention_backend

    @property
    def architecture(self) -> ModelArchitecture:
        """model_architecture, by its short name."""
        return self.model_architecture

    @property
    def choices(self) -> list[Choice]:
        """Every component's Choice, in explain's order: attention, model, executor, graph, then moe and
        quantization where they apply."""
        extra = [c for c in (self.moe, self.quantization) if c is not None]
        return [self.attention, self.model, self.executor, self.graph, *extra]

    def summary(self) -> str:
        """One line: the chosen backend, model, executor and graph mode, each with its plugin, and the KV
        cache dtype where kv_cache_dtype sets one."""
        a, m, e, g = (c.chosen for c in self.choices[:4])
        graph = g.name if g.name == self.effective_graph.name else f"{g.name} -> {self.effective_graph.name}"
        extra = [f"MoE kernel {self.moe.chosen.name}"] if self.moe else []
        extra += [f"quantization {self.quantization.chosen.name}"] if self.quantization else []
        extra += [f"KV cache {self.kv_cache_description()}"] if self.kv_cache_dtype != "auto" else []
        return ", ".join([
            f"attention {a.name} ({a.plugin}), model {m.name} ({m.plugin}), executor {e.name} ({e.plugin})",
            f"graph mode {graph}, {self.platform.device_type} {str(self.dtype).removeprefix('torch.')}",
            *extra,
        ])  # fmt: skip
