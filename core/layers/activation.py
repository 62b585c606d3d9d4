from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from turnout.layers import fused, gemv


@dataclass
class PendingSiluMul:
    """silu(gate) * up of x = gate_up [M, 2I], which the next row-parallel linear computes as its GEMV reads
    x (gemv's silu_mul prologue)."""

    x: torch.Tensor  # [M, 2I]

    def materialize(self) -> torch.Tensor:
        return fused.silu_and_mul(self.x)


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up, gate first as in gate_up_proj. One fused kernel on CUDA.
    feeds_linear: the output goes straight into a turnout row-parallel linear; at decode sizes that
    linear's GEMV then applies it, and the output is a PendingSiluMul that only such a linear accepts."""

    def __init__(self, feeds_linear: bool = False) -> None:
        super().__init__()
        self.feeds_linear = feeds_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor | PendingSiluMul:
        if self.feeds_linear and fused.enabled(x) and gemv.enabled(x):
            return PendingSiluMul(x)
        if fused.enabled(x):
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
