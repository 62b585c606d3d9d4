"""RMSNorm, computed in float32 and rounded to the activation dtype as HF does, and Gemma's form with a unit
offset on the weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from turnout.layers import fused


@dataclass
class PendingNorm:
    """RMSNorm(x [+ residual]) that the next linear layer computes in its GEMV's prologue. x + residual goes
    to residual_out, which the caller already holds: consuming this (the GEMV, or materialize) writes it."""

    x: torch.Tensor  # [M, K]
    residual: torch.Tensor | None  # [M, K]
    weight: torch.Tensor  # [K]
    eps: float
    residual_out: torch.Tensor  # [M, K]; x itself when residual is None (nothing to add)

    def materialize(self) -> torch.Tensor:
        """The normed rows [M, K], computed now by the fused norm kernel (x + residual to residual_out)."""
        if self.residual is None:
            return fused.rms_norm(self.x, self.weight, self.eps)
        return fused.rms_norm(self.x, self.weight, self.eps, self.residual, self.residual_out)[0]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, as HF's LlamaRMSNorm: w * (x / sqrt(mean(x^2) + eps)), the normalising in
    float32, rounded to x's dtype, then times the weight (init ones). With a residual it adds first, in x's
    dtype, and returns (normed, x + residual): the fused residual add of a pre-norm decoder.

    On CUDA one fused kernel (layers/fused.py) does it all. feeds_linear: the output goes straight into a
    turnout column-parallel linear, so on CUDA it is a PendingNorm that only such a linear accepts; the
    linear runs the norm in its GEMV's prologue at decode sizes (gemv.enabled), or in its quantization
    method's input quantization (LinearMethod.apply_pending), or else materializes it first."""

    unit_offset = False  # True in GemmaRMSNorm: the weight is applied as (1 + w)

    def __init__(self, hidden: int, eps: float = 1e-6, feeds_linear: bool = False) -> None:
        super().__init__()
        self.eps, self.feeds_linear = eps, feeds_linear
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | PendingNorm | tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """x [..., hidden] -> normed, or with residual (same shape) -> (norm(x + residual), x + residual)."""
        if self.feeds_linear and fused.enabled(x) and x.dim() == 2:
            res_out = x if residual is None else torch.empty_like(x)
            pending = PendingNorm(x, residual, self.weight, self.eps, res_out)
            return pending if residual is None else (pending, res_out)
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), all in float32 and rounded to x's dtype once at
    the end, as HF's GemmaRMSNorm (the checkpoint stores w, init zeros). The residual add is RMSNorm's. On
    CUDA the fused kernel does it with unit_offset; the GEMV prologue (feeds_linear) does not apply it."""

    unit_offset = True

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__(hidden, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> normed, or with residual (same shape) -> (norm(x + residual), x + residual)."""
        if fused.enabled(x) and (x.dim() == 2 or residual is None):
            return fused.rms_norm(x, self.weight, self.eps, residual, unit_offset=True)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
