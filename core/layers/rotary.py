"""Rotary position embedding (HF's rotate-half layout) with every frequency scaling of HF transformers'
modeling_rope_utils (linear, dynamic NTK, Llama 3, YaRN, LongRoPE), the per-head q/k RMSNorm that Qwen3
applies just before it, and rope_parameters_for, which reads one layer type's rope from a config.json."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from turnout.layers import fused
from turnout.layers.norm import RMSNorm


def _powers(base: float, dim: int) -> torch.Tensor:
    """[dim / 2] float32: base^(2i / dim), the reciprocal of the unscaled inv_freq."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


# Each scaling kind: (base, dim, max_position, the scaling dict) -> (inv_freq, attention factor); inv_freq is
# [dim / 2] for every position, or [rows, dim / 2] row by row where the frequencies depend on the position.
# The float32 arithmetic follows HF's order of operations, so the results are HF's bits.
_Scaling = Callable[[float, int, int, dict[str, Any]], tuple[torch.Tensor, float]]


def _default(base: float, dim: int, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    return 1.0 / _powers(base, dim), 1.0


def _linear(base: float, dim: int, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    return 1.0 / _powers(base, dim) / s["factor"], 1.0


def _llama3(base: float, dim: int, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / _powers(base, dim)
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(base: float, dim: int, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    old_ctx = s.get("original_max_position_embeddings") or max_position
    factor = s.get("factor") or max_position / old_ctx
    powers = _powers(base, dim)
    keep = _yarn_extrapolation(s, dim, base, old_ctx)
    inv_freq = 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep
    return inv_freq, _yarn_attention_factor(s, factor)


def _yarn_extrapolation(s: dict[str, Any], dim: int, base: float, old_ctx: int) -> torch.Tensor:
    """[dim / 2]: 1 for the pairs that turn more than beta_fast times in old_ctx (kept as trained), 0 for
    those that turn fewer than beta_slow times (interpolated), a linear ramp over the pair index between."""

    def pair_at(turns: float) -> float:  # the fractional pair index whose wavelength is old_ctx / turns
        return dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_at(s.get("beta_fast") or 32), pair_at(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1 - ramp


def _yarn_attention_factor(s: dict[str, Any], factor: float) -> float:
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek's form
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _dynamic(base: float, dim: int, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Row p holds the frequencies HF's dynamic NTK update gives a forward whose last position is p:
    the base grows with seq_len = max(p + 1, max_position), up to max_position * factor rows. Like HF's
    KV-cached decoding, a position keeps the frequencies it got when it was computed."""
    factor, m = s["factor"], max_position
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    grow = lambda seq_len: base * ((factor * seq_len / m) - (factor - 1)) ** (dim / (dim - 2))
    first = 1.0 / (grow(m) ** exponents)  # HF's initial frequencies, from Python floats
    # HF grows the base from a 0-dim tensor seq_len; torch's vectorised pow differs from it in the last bit
    grown = torch.arange(m + 1, dynamic_positions(m, s) + 1)
    bases = torch.stack([grow(n) for n in grown]) if len(grown) else torch.empty(0)
    return torch.cat([first.expand(m, -1), 1.0 / (bases[:, None] ** exponents)]), 1.0


def dynamic_positions(max_position: int, s: dict[str, Any]) -> int:
    """The positions dynamic NTK scaling serves: max_position_embeddings times its factor (ModelInfo's
    max_position_embeddings gives the engine the same figure)."""
    return max(max_position, int(max_position * s["factor"]))


def _longrope(base: float, dim: int, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Positions below original_max_position_embeddings turn at inv_freq / short_factor, the rest at
    inv_freq / long_factor: per position, the factors HF's LongRoPE update picks for a forward ending
    there."""
    old_ctx = s.get("original_max_position_embeddings") or max_position
    short, long = (_longrope_factors(s, key, dim) for key in ("short_factor", "long_factor"))
    powers = _powers(base, dim)
    inv = lambda ext: 1.0 / (ext * powers)
    keep = min(old_ctx, max_position)
    inv_freq = torch.cat([inv(short).expand(keep, -1), inv(long).expand(max_position - keep, -1)])
    factor = s.get("factor") or max_position / old_ctx
    if s.get("attention_factor") is not None:
        return inv_freq, s["attention_factor"]
    return inv_freq, 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))


def _longrope_factors(s: dict[str, Any], key: str, dim: int) -> torch.Tensor:
    ext = s.get(key)
    if not isinstance(ext, (list, tuple)) or len(ext) != dim // 2:
        got = f"{len(ext)} numbers" if isinstance(ext, (list, tuple)) else repr(ext)
        raise ValueError(f"rope scaling 'longrope' needs {key} as a list of {dim // 2} numbers (got {got})")
    return torch.tensor(ext, dtype=torch.float32)


_SCALINGS: dict[str, _Scaling] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "su": _longrope,  # Phi-3's first name for LongRoPE
}


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over the last dim of q and k, with cos/sin tables built once, in float32,
    from inv_freq = 1 / base^(2i / head_size), for positions [0, max_position) (dynamic NTK: up to
    max_position * factor).

    - Rotation style: NeoX / HF rotate-half only: element i pairs with i + head_size / 2. GPT-J's
      interleaved pairs (2i, 2i + 1) are not supported; permute such a checkpoint's q/k rows at load.
    - Partial rotary: build it with head_size = the rotated dims and pass q[..., :rot], k[..., :rot], then
      concatenate the unrotated rest of each head back (the NeoX example plugin does this).
    - scaling: one flat HF rope_scaling / rope_parameters dict (rope_parameters_for picks a layer type's
      from a nested one), its kind read from "rope_type" (or the older "type"), computed as HF
      transformers' modeling_rope_utils does:
      - None or "default": plain.
      - "linear": inv_freq / factor, i.e. positions divided by factor (Gemma 3's global layers).
      - "dynamic" (NTK): below max_position the plain frequencies; position p past it turns at the base
        HF grows for p + 1 tokens, base * (factor (p + 1) / max_position - factor + 1)^(d / (d - 2)).
      - "llama3": Llama 3.1's frequency smoothing, reading factor, original_max_position_embeddings,
        low_freq_factor (default 1.0) and high_freq_factor (default 4.0).
      - "yarn" (Qwen3 / Qwen2.5 long context): each frequency blends from inv_freq / factor (pairs that turn
        fewer than beta_slow times in original_max_position_embeddings) to inv_freq (more than beta_fast
        turns), over a ramp of pair indices rounded outwards unless truncate is false. cos and sin are
        multiplied by attention_factor, which defaults to 0.1 ln(factor) + 1 (1 for factor <= 1), or with
        both mscale and mscale_all_dim to the ratio of that form with each. HF's defaults: beta_fast 32,
        beta_slow 1, original_max_position_embeddings max_position, factor max_position / original.
      - "longrope" (or "su"; Phi-3, Phi-4): positions below original_max_position_embeddings turn at
        inv_freq / short_factor, the rest at inv_freq / long_factor (lists of head_size / 2), cos and sin
        times attention_factor, by default sqrt(1 + ln(factor) / ln(original)) with factor defaulting to
        max_position / original.
      The two position-dependent kinds (dynamic, longrope) give position p what HF gives it in KV-cached
      decoding, where each position keeps the frequencies of the forward that computed it; HF's one-forward
      prefill of a prompt past the switch rotates its earlier positions the long way too, which no KV cache
      shared between prompts (prefix caching) or split over steps (chunked prefill) could match.
      Any other kind, or a dict nested by layer type, raises ValueError naming it at construction. Other
      keys (rope_theta, partial_rotary_factor, ...) are ignored: pass the base and the rotated head_size."""

    def __init__(
        self, head_size: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        scaling = scaling or {}
        if nested := sorted(k for k, v in scaling.items() if isinstance(v, dict)):
            raise ValueError(
                f"rope parameters nested by layer type ({', '.join(nested)}) are one dict per layer type; "
                "pass one layer type's (turnout.layers.rope_parameters_for(hf_config, layer_type))"
            )
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind not in _SCALINGS:
            raise ValueError(f"rope scaling '{kind}' is not supported (supported: {', '.join(_SCALINGS)})")
        # float32 throughout, as HF computes it, so positions get bit-identical angles
        try:
            inv_freq, attention_factor = _SCALINGS[kind](base, head_size, max_position, scaling)
        except KeyError as e:
            raise ValueError(f"rope scaling '{kind}' needs {e.args[0]} in its parameters") from None
        rows = inv_freq.shape[0] if inv_freq.dim() == 2 else max_position
        freqs = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq
        # [rows, head_size / 2]; the attention factor scales both, as HF scales its cos and sin
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

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
        heads right after q's) and the two norms are of one kind (both RMSNorm or both GemmaRMSNorm), one
        fused kernel does the norms and the rotation and writes new q and k."""
        offset = {getattr(n, "unit_offset", False) for n in (q_norm, k_norm) if n is not None}
        if fused.enabled(q) and len(offset) < 2 and (qk := _packed(q, k)) is not None:
            w = (
                (q_norm.weight, k_norm.weight, q_norm.eps)
                if q_norm is not None and k_norm is not None
                else (None, None, 0.0)
            )
            return fused.qk_norm_rope(
                qk, positions, q.shape[1], k.shape[1], self.cos, self.sin, *w, unit_offset=True in offset
            )
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


def rope_parameters_for(
    hf_config: dict[str, Any], layer_type: str | None = None
) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the flat scaling dict for RotaryEmbedding) of a config.json's dict: its rope_scaling or
    rope_parameters, and where transformers 5 nests rope_parameters by layer type (Gemma 3's
    {"full_attention": {...}, "sliding_attention": {...}}), the inner dict of layer_type. A flat dict serves
    every layer type. rope_theta is the dict's, else the config's top-level one, else 10000."""
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested and layer_type not in nested:
        raise ValueError(
            f"config.json's rope_parameters are nested by layer type ({', '.join(nested)}); "
            f"layer type {layer_type!r} is not one of them"
        )
    if nested:
        rope = rope[layer_type]
    base = rope.get("rope_theta") or hf_config.get("rope_theta") or 10000.0
    return base, {k: v for k, v in rope.items() if k != "rope_theta"}
