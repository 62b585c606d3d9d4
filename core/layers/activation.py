"""Gated activations for the MLP's fused gate_up projection: [..., 2d] -> act(gate) * up, gate first."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from turnout.layers import fused


@dataclass
class PendingSiluMul:
    """silu(gate) * up of x = gate_up [M, 2I], which the next row-parallel linear computes as its GEMV reads
    x (gemv's silu_mul prologue), in its quantization method's input quantization, or materializes."""

    x: torch.Tensor  # [M, 2I]

    def materialize(self) -> torch.Tensor:
        """silu(gate) * up [M, I], computed now by the fused kernel."""
        return fused.silu_and_mul(self.x)


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up, gate first as in gate_up_proj. One fused kernel on CUDA.
    feeds_linear: the output goes straight into a turnout row-parallel linear, so on CUDA it is a
    PendingSiluMul that only such a linear accepts (applied in its GEMV at decode sizes, in its quantization
    method's input quantization, or materialized first)."""

    def __init__(self, feeds_linear: bool = False) -> None:
        super().__init__()
        self.feeds_linear = feeds_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor | PendingSiluMul:
        """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], in x's dtype (or the PendingSiluMul above)."""
        if self.feeds_linear and fused.enabled(x) and x.dim() == 2:
            return PendingSiluMul(x)
        if fused.enabled(x):
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [..., d] buffer fewer, the same bits


class GeluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: gelu(gate) * up, gate first (Gemma's MLP). approximate: "none" for the exact
    erf GELU, "tanh" for its tanh approximation (HF's gelu_pytorch_tanh), as torch.nn.functional.gelu
    takes it. One fused kernel on CUDA; in x's dtype."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GeluAndMul approximate must be 'none' or 'tanh', not {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2d] -> gelu(x[..., :d]) * x[..., d:]."""
        if fused.enabled(x) and x.dim() == 2:
            return fused.gelu_and_mul(x, self.approximate)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
