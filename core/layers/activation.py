from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turnout.layers import fused


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up, gate first as in gate_up_proj."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x):
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
