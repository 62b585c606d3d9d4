"""Fused CUDA kernels (Triton) for the small ops between the GEMMs of a decoder layer.

Eager PyTorch spends about ten kernels on an RMSNorm, twelve on a rotary embedding and three on SiLU-and-mul;
at batch 1 a CUDA graph of a 28-layer model is then ~1700 tiny kernels whose launch gaps, not the weight
reads, set the decode time. Here each is one kernel:

- `rms_norm`: optional residual add, then RMSNorm over the last dim, rows given by (token, head) strides.
- `qk_norm_rope`: from the packed qkv rows, per-head RMSNorm of q and k (Qwen3) and the rotary embedding,
  written to contiguous q [T, Hq, D] and k [T, Hkv, D].
- `silu_and_mul` and `gelu_and_mul`: [T, 2I] -> [T, I].

Gemma's norms (the weight applied as 1 + w, one rounding at the end) are the same two kernels with
unit_offset.

The kernels are in layers/triton_kernels.py (`kernels()` imports it). They round as the eager torch path
does, so fused and eager agree to about an ulp: the order of the float32 sum in the norm and the GPU
compiler's fused multiply-adds differ. The layers they replace (RMSNorm, GemmaRMSNorm, RotaryEmbedding,
SiluAndMul, GeluAndMul) call
them on CUDA (TURNOUT_FUSED_KERNELS=0 turns them off); the CPU keeps the torch path, and the tests run
these kernels under TRITON_INTERPRET=1 against a float64 reference.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from turnout import envs
from turnout.layers import pdl


def enabled(x: torch.Tensor) -> bool:
    """Whether layers use these kernels for x: on CUDA, unless TURNOUT_FUSED_KERNELS=0 (for comparisons)."""
    return x.is_cuda and switched_on()


@functools.cache
def switched_on() -> bool:
    """TURNOUT_FUSED_KERNELS (default 1), read once: enabled() runs on every layer's call."""
    return envs.FUSED_KERNELS.value


@functools.cache
def kernels() -> ModuleType:
    """layers/triton_kernels.py, imported on first use so that importing turnout never imports triton. A
    call after cache_clear() reloads it when TRITON_INTERPRET changed since (tests build the kernels for the
    interpreter, which triton decides when a kernel is defined)."""
    from turnout.layers import triton_kernels

    if triton_kernels.INTERPRET != (os.environ.get("TRITON_INTERPRET") == "1"):
        triton_kernels = importlib.reload(triton_kernels)
    return triton_kernels


# Heads of one token a qk_norm_rope program rotates: one head a program made a 16k-token prefill 655k
# programs of 128 values each, at ~10% of the H200's bandwidth (28 of a 16k prefill's 542 ms at the 8B shape).
QK_HEADS_PER_PROGRAM = 8


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def rms_norm(
    x: torch.Tensor,  # [T, N] or [T, H, N]; the last dim contiguous
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N] contiguous; only with 2-D x
    residual_out: torch.Tensor | None = None,  # [T, N] contiguous: where x + residual goes (default: new)
    unit_offset: bool = False,  # Gemma's: the weight applied as 1 + w
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) or, with a residual, (RMSNorm(x + residual), x + residual)."""
    kn = kernels()
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, H, N]
    t, h, n = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    res_out = out
    if residual is not None:
        res_out = residual_out if residual_out is not None else torch.empty_like(x)
    res = residual if residual is not None else x
    block = kn.next_power_of_2(n)
    if t:
        kn.rms_norm_kernel[(t, h)](
            x3, res, weight, out, res_out, x3.stride(0), x3.stride(1), res.stride(0),
            out.stride(0), out.stride(1), res_out.stride(0), n, eps,
            HAS_RES=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block, num_warps=_warps(block),
            **pdl.launch(),
        )  # fmt: skip
    out = out.view(x.shape)
    return (out, res_out) if residual is not None else out


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D], rows may be strided
    positions: torch.Tensor,  # [T]
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,  # [max_position, D / 2] float32
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,  # [D] Qwen3's q_norm, or None for no q/k norm
    k_weight: torch.Tensor | None,
    eps: float,
    unit_offset: bool = False,  # Gemma's norms: the weights applied as 1 + w
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D], contiguous
    kn = kernels()
    t, half = qkv.shape[0], cos.shape[1]
    q = torch.empty(t, num_heads, 2 * half, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, 2 * half, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None and k_weight is not None
    qw = q_weight if q_weight is not None else q  # unread when NORM is off
    kw = k_weight if k_weight is not None else k
    heads = num_heads + num_kv_heads
    hb = min(QK_HEADS_PER_PROGRAM, kn.next_power_of_2(heads))
    if t:
        kn.qk_norm_rope_kernel[(t, -(-heads // hb))](
            qkv, q, k, qw, kw, cos, sin, positions, qkv.stride(0), q.stride(0), k.stride(0),
            cos.stride(0), eps, HQ=num_heads, HK=num_kv_heads, HALF=half, HALF_P2=kn.next_power_of_2(half),
            HB=hb, NORM=norm, UNIT_OFFSET=unit_offset, num_warps=max(1, hb // 4), **pdl.launch(),
        )  # fmt: skip
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    return _act_and_mul(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """approximate: "none" (erf) or "tanh", as torch.nn.functional.gelu takes it."""
    return _act_and_mul(x, "gelu_tanh" if approximate == "tanh" else "gelu")


def _act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    kn = kernels()
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block = min(1024, kn.next_power_of_2(n))
    if t:
        kn.act_and_mul_kernel[(t, -(-n // block))](
            x, out, x.stride(0), out.stride(0), n, ACT=kn.ACTS[act], BLOCK=block, num_warps=4, **pdl.launch()
        )
    return out
