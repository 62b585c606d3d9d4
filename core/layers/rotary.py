"""Rotary position embedding (HF's rotate-half layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_size: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        # float32 throughout, as HF computes it, so positions get bit-identical angles
        inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size)
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif kind not in (None, "default"):
            raise ValueError(f"rope scaling '{kind}' is not supported (supported: default, llama3)")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, head_size / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D]. Angles are float32; like HF, the rotation itself runs
        in the activations' dtype."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D/2]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
