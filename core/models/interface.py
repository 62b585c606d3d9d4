"""The model contract: what the model runner calls on the class a ModelArchitecture loads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn


@runtime_checkable
class CausalLM(Protocol):
    """A torch.nn.Module built as `cls(hf_config)` (config.json as a dict) under the target device and
    dtype, so that every parameter and buffer it makes is already where it runs.

    Its attention goes through turnout.layers.Attention: the runner finds those layers by walking
    modules(), numbers them, and gives each its KV cache; models never see the attention backend. Under
    tensor parallelism the model uses turnout.layers' parallel linears and embeddings (or asserts a TP size
    of 1); under pipeline parallelism it builds only this stage's layers (turnout.models.layer_range).
    """

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """nn.Module's call of forward."""
        ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden states [T, hidden] after the final norm. A later
        pipeline stage gets `intermediate` [2, T, hidden] instead of embedding input_ids; a stage before
        the last returns that pair (hidden, residual) stacked. A captured CUDA graph replays this call, so
        it must not read device values on the host."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] logits, full vocabulary on every rank."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume the checkpoint's (name, tensor) pairs; return the names of the parameters loaded (as in
        named_parameters()). A parameter left out is an error naming it. Fill parameters only: within
        turnout.loader.weights.reuse_weights a later model of the same checkpoint takes the first one's
        parameter tensors by name instead of this call."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """nn.Module's (name, parameter) pairs; every name must be among those load_weights returns, or
        loading fails naming it."""
        ...

    def parameters(self) -> Iterator[nn.Parameter]:
        """nn.Module's parameters: every weight this rank holds (the runner reports their bytes)."""
        ...

    def modules(self) -> Iterator[nn.Module]:
        """nn.Module's walk of every submodule: the runner finds the Attention layers through it."""
        ...

    def eval(self) -> Any:
        """nn.Module's eval(), which returns the model; the runner calls it once the weights are loaded."""
        ...
