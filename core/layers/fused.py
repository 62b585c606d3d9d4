"""Fused CUDA kernels (Triton) for the small ops between the GEMMs of a decoder layer.

Eager PyTorch spends about ten kernels on an RMSNorm, twelve on a rotary embedding and three on SiLU-and-mul;
at batch 1 a CUDA graph of a 28-layer model is then ~1700 tiny kernels whose launch gaps, not the weight
reads, set the decode time. Here each is one kernel:

- `rms_norm`: optional residual add, then RMSNorm over the last dim, rows given by (token, head) strides.
- `qk_norm_rope`: from the packed qkv rows, per-head RMSNorm of q and k (Qwen3) and the rotary embedding,
  written to contiguous q [T, Hq, D] and k [T, Hkv, D].
- `silu_and_mul`: [T, 2I] -> [T, I].

Every kernel rounds to the activation dtype where the eager torch path does (after the residual add,
after the norm, after each product of the rotation), so fused and eager agree to about an ulp: the order
of the float32 sum in the norm and the GPU compiler's fused multiply-adds differ. The layers they replace
(RMSNorm, RotaryEmbedding, SiluAndMul) call them on CUDA (TURNOUT_FUSED_KERNELS=0 turns them off); the
CPU keeps the torch path, and the tests run these kernels under TRITON_INTERPRET=1 against a float64
reference. Each is launched with pdl.launch() and, under PDL, waits for the kernel before it first
(layers/pdl.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

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
def _kernels() -> SimpleNamespace:
    """The @triton.jit kernels, built on first use so that importing turnout never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(
        x, res, w, out, res_out, s_xt, s_xh, s_rt, s_ot, s_oh, s_rot, n, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (T, H): one row of n values at x[t, h]."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t, h = tl.program_id(0), tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        xv = tl.load(x + t * s_xt + h * s_xh + cols, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(res + t * s_rt + cols, mask=m, other=0.0)
            xv = (xv.to(tl.float32) + r.to(tl.float32)).to(xv.dtype)
            tl.store(res_out + t * s_rot + cols, xv, mask=m)
        xf = xv.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
        y = (xf * rstd).to(xv.dtype).to(tl.float32)
        wv = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out + t * s_ot + h * s_oh + cols, (wv * y).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def qk_norm_rope_kernel(
        qkv, q_out, k_out, q_w, k_w, cos, sin, positions, s_t, s_qt, s_kt, s_c, eps,
        HQ: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (T, Hq + Hkv): head h of token t; q heads first, as packed in qkv's rows."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t, h = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, HALF_P2)
        m = i < HALF
        qm, km = m & (i * 0 + h < HQ), m & (i * 0 + h >= HQ)  # this head is q / is k
        src = qkv + t * s_t + h * 2 * HALF
        x1 = tl.load(src + i, mask=m, other=0.0)  # [HALF_P2], the rotate-half layout's two halves
        x2 = tl.load(src + HALF + i, mask=m, other=0.0)
        dt = x1.dtype
        if NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / (2 * HALF) + eps)
            w1 = tl.load(q_w + i, mask=qm, other=0.0) + tl.load(k_w + i, mask=km, other=0.0)
            w2 = tl.load(q_w + HALF + i, mask=qm, other=0.0)
            w2 += tl.load(k_w + HALF + i, mask=km, other=0.0)
            x1 = (w1.to(tl.float32) * (f1 * rstd).to(dt).to(tl.float32)).to(dt)
            x2 = (w2.to(tl.float32) * (f2 * rstd).to(dt).to(tl.float32)).to(dt)
        pos = tl.load(positions + t)
        c = tl.load(cos + pos * s_c + i, mask=m, other=0.0).to(dt).to(tl.float32)
        s = tl.load(sin + pos * s_c + i, mask=m, other=0.0).to(dt).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        q_dst = q_out + t * s_qt + h * 2 * HALF
        k_dst = k_out + t * s_kt + (h - HQ) * 2 * HALF
        tl.store(q_dst + i, o1, mask=qm)
        tl.store(q_dst + HALF + i, o2, mask=qm)
        tl.store(k_dst + i, o1, mask=km)
        tl.store(k_dst + HALF + i, o2, mask=km)

    @triton.jit
    def silu_and_mul_kernel(x, out, s_xt, s_ot, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Grid (T, cdiv(n, BLOCK)): out[t, j] = silu(x[t, j]) * x[t, n + j], rounded as torch does."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t, b = tl.program_id(0), tl.program_id(1)
        j = b * BLOCK + tl.arange(0, BLOCK)
        m = j < n
        g = tl.load(x + t * s_xt + j, mask=m, other=0.0)
        u = tl.load(x + t * s_xt + n + j, mask=m, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(out + t * s_ot + j, (act * u).to(out.dtype.element_ty), mask=m)

    return SimpleNamespace(
        rms_norm_kernel=rms_norm_kernel,
        qk_norm_rope_kernel=qk_norm_rope_kernel,
        silu_and_mul_kernel=silu_and_mul_kernel,
        next_power_of_2=triton.next_power_of_2,
    )


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def rms_norm(
    x: torch.Tensor,  # [T, N] or [T, H, N]; the last dim contiguous
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N] contiguous; only with 2-D x
    residual_out: torch.Tensor | None = None,  # [T, N] contiguous: where x + residual goes (default: new)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) or, with a residual, (RMSNorm(x + residual), x + residual)."""
    kn = _kernels()
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
            HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block), **pdl.launch(),
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
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D], contiguous
    kn = _kernels()
    t, half = qkv.shape[0], cos.shape[1]
    q = torch.empty(t, num_heads, 2 * half, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, 2 * half, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None and k_weight is not None
    qw = q_weight if q_weight is not None else q  # unread when NORM is off
    kw = k_weight if k_weight is not None else k
    if t:
        kn.qk_norm_rope_kernel[(t, num_heads + num_kv_heads)](
            qkv, q, k, qw, kw, cos, sin, positions, qkv.stride(0), q.stride(0), k.stride(0),
            cos.stride(0), eps, HQ=num_heads, HALF=half, HALF_P2=kn.next_power_of_2(half), NORM=norm,
            num_warps=1, **pdl.launch(),
        )  # fmt: skip
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    kn = _kernels()
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block = min(1024, kn.next_power_of_2(n))
    if t:
        kn.silu_and_mul_kernel[(t, -(-n // block))](
            x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **pdl.launch()
        )
    return out
