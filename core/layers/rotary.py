"""Rotary position embedding (HF's rotate-half layout), with Llama 3 frequency scaling, and the per-head
q/k RMSNorm that Qwen3 applies just before it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from turnout.layers import fused
from turnout.layers.norm import RMSNorm


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
    """Rotary position embedding over the last dim of q and k, with cos/sin tables for positions
    [0, max_position) built once, in float32, from inv_freq = 1 / base^(2i / head_size).

    - Rotation style: NeoX / HF rotate-half only: element i pairs with i + head_size / 2. GPT-J's
      interleaved pairs (2i, 2i + 1) are not supported; permute such a checkpoint's q/k rows at load.
    - Partial rotary: build it with head_size = the rotated dims and pass q[..., :rot], k[..., :rot], then
      concatenate the unrotated rest of each head back (the NeoX example plugin does this).
    - scaling: the HF rope_scaling / rope_parameters dict, its kind read from "rope_type" (or the older
      "type"). None or "default": plain. "llama3": Llama 3.1's frequency smoothing, reading factor,
      original_max_position_embeddings, low_freq_factor (default 1.0) and high_freq_factor (default 4.0).
      Any other kind (linear, dynamic, yarn, longrope, ...) raises ValueError at construction. Other keys
      (rope_theta, ...) are ignored: pass the base yourself."""

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
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        q_norm: RMSNorm | None = None,  # per-head norms applied before the rotation (Qwen3)
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) rotated at their positions, same shapes. With both q_norm and k_norm, each head of q and k
        is RMS-normed first (Qwen3; a GemmaRMSNorm works too). Angles are float32; like HF, the rotation
        itself runs in the activations' dtype. On CUDA, when q and k are views of one packed qkv row (k's
        heads right after q's) and the norms are plain RMSNorms, one fused kernel does the norms and the
        rotation and writes new q and k."""
        fusable = not (getattr(q_norm, "unit_offset", False) or getattr(k_norm, "unit_offset", False))
        if fused.enabled(q) and fusable and (qk := _packed(q, k)) is not None:
            w = (
                (q_norm.weight, k_norm.weight, q_norm.eps)
                if q_norm is not None and k_norm is not None
                else (None, None, 0.0)
            )
            return fused.qk_norm_rope(qk, positions, q.shape[1], k.shape[1], self.cos, self.sin, *w)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D/2]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def _packed(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, (Hq + Hkv) D]: the rows of q and k as one strided tensor, when k's heads follow q's in memory
    with the same row stride (q and k split from one qkv projection); else None."""
    (t, hq, d), hkv = q.shape, k.shape[1]
    if k.shape != (t, hkv, d) or q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1):
        return None
    if k.data_ptr() != q.data_ptr() + hq * d * q.element_size():
        return None
    if t > 1 and k.stride(0) != q.stride(0):  # one row has no row stride to agree on
        return None
    return q.as_strided((t, (hq + hkv) * d), (q.stride(0) if t > 1 else (hq + hkv) * d, 1))
