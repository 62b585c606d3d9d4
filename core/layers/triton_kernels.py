"""The @triton.jit kernels of layers/fused.py and layers/gemv.py, and the pdl_wait they share.

This module imports triton; fused.kernels() imports it on first use, so importing turnout never does.
Each kernel is launched with pdl.launch() and starts with pdl_wait (layers/pdl.py): under PDL it waits
for the kernel before it, having read only what no earlier kernel writes. Every kernel rounds to the
activation dtype where the eager torch path does (after the residual add, after a norm, after each product
of a rotation), so fused and eager agree to about an ulp.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # when this module was (re)loaded
next_power_of_2 = triton.next_power_of_2


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before has finished and its writes are visible, then let the
    kernel after start its own reads of what no kernel writes."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Row helpers, public through turnout.layers, so that a plugin's kernel computing a norm or an activation
# in its prologue rounds exactly as these kernels do.
@triton.jit
def add_residual(x, r):
    """x + r in float32, rounded to x's dtype: the residual stream as torch and every kernel here add it."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def rms_norm_weighted(x, w, rstd, UNIT_OFFSET: tl.constexpr):
    """RMSNorm's output in float32 for x (activation dtype) and rstd (broadcast against x): with UNIT_OFFSET
    (Gemma) (1 + w) times the unrounded normed x, else w times the normed x rounded to x's dtype first. The
    caller rounds once, to its output's dtype."""
    xf = x.to(tl.float32) * rstd
    if UNIT_OFFSET:
        y = xf * (1.0 + w.to(tl.float32))
    else:
        y = w.to(tl.float32) * xf.to(x.dtype).to(tl.float32)
    return y


@triton.jit
def rms_norm_row(x, res, res_out, w, cols, n, eps, HAS_RES: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """RMSNorm of one row x [BLOCK] (loaded, zero where cols >= n), res, res_out and w pointing at its
    residual row, where the residual stream goes and the weight: the normed row in float32, for the caller
    to round once. Where HAS_RES, the row normed is x + residual, rounded to x's dtype, stored at res_out."""
    m = cols < n
    if HAS_RES:
        x = add_residual(x, tl.load(res + cols, mask=m, other=0.0))
        tl.store(res_out + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    return rms_norm_weighted(x, tl.load(w + cols, mask=m, other=0.0), rstd, UNIT_OFFSET)


@triton.jit
def silu_mul(g, u):
    """silu(g) * u in float32, SiLU rounded to g's dtype before the product as torch rounds it. The caller
    rounds the product."""
    gf = g.to(tl.float32)
    return (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * u.to(tl.float32)


@triton.jit
def rms_norm_kernel(
    x, res, w, out, res_out, s_xt, s_xh, s_rt, s_ot, s_oh, s_rot, n, eps,
    HAS_RES: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, H): one row of n values at x[t, h]. UNIT_OFFSET (Gemma): the weight applies as 1 + w in
    float32 to the unrounded normed row, one rounding at the end; else w times the row rounded first."""
    pdl_wait(PDL)
    t, h = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    xv = tl.load(x + t * s_xt + h * s_xh + cols, mask=m, other=0.0)
    y = rms_norm_row(xv, res + t * s_rt, res_out + t * s_rot, w, cols, n, eps, HAS_RES, UNIT_OFFSET)
    tl.store(out + t * s_ot + h * s_oh + cols, y.to(out.dtype.element_ty), mask=m)


@triton.jit
def qk_norm_rope_kernel(
    qkv, q_out, k_out, q_w, k_w, cos, sin, positions, s_t, s_qt, s_kt, s_c, eps,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, HB: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, cdiv(Hq + Hkv, HB)): heads [HB * pid1, +HB) of token t, q heads first, as packed in qkv's
    rows; each row of the [HB, HALF_P2] tiles is one head's two rotate-half halves. The norm rounds as
    rms_norm_kernel does for the same UNIT_OFFSET."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]  # [HB, 1]
    i = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    m = (i < HALF) & (h < HQ + HK)
    qm, km = m & (h < HQ), m & (h >= HQ)  # this head is q / is k
    src = qkv + t * s_t + h * 2 * HALF
    x1 = tl.load(src + i, mask=m, other=0.0)  # [HB, HALF_P2]
    x2 = tl.load(src + HALF + i, mask=m, other=0.0)
    dt = x1.dtype
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)  # [HB]
        w1 = tl.load(q_w + i, mask=qm, other=0.0) + tl.load(k_w + i, mask=km, other=0.0)
        w2 = tl.load(q_w + HALF + i, mask=qm, other=0.0)
        w2 += tl.load(k_w + HALF + i, mask=km, other=0.0)
        x1 = rms_norm_weighted(x1, w1, rstd[:, None], UNIT_OFFSET).to(dt)
        x2 = rms_norm_weighted(x2, w2, rstd[:, None], UNIT_OFFSET).to(dt)
    pos = tl.load(positions + t)
    c = tl.load(cos + pos * s_c + i, mask=i < HALF, other=0.0).to(dt).to(tl.float32)  # [1, HALF_P2]
    s = tl.load(sin + pos * s_c + i, mask=i < HALF, other=0.0).to(dt).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    q_dst = q_out + t * s_qt + h * 2 * HALF
    k_dst = k_out + t * s_kt + (h - HQ) * 2 * HALF
    tl.store(q_dst + i, o1, mask=qm)
    tl.store(q_dst + HALF + i, o2, mask=qm)
    tl.store(k_dst + i, o1, mask=km)
    tl.store(k_dst + HALF + i, o2, mask=km)


ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}  # act_and_mul_kernel's ACT


@triton.jit
def act_and_mul_kernel(x, out, s_xt, s_ot, n, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, cdiv(n, BLOCK)): out[t, j] = act(x[t, j]) * x[t, n + j], act (ACTS) SiLU, the exact (erf) GELU
    or its tanh approximation, in float32 and rounded before the product as torch does."""
    pdl_wait(PDL)
    t, b = tl.program_id(0), tl.program_id(1)
    j = b * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    g = tl.load(x + t * s_xt + j, mask=m, other=0.0)
    u = tl.load(x + t * s_xt + n + j, mask=m, other=0.0)
    if ACT == 0:
        y = silu_mul(g, u)
    else:
        gf = g.to(tl.float32)
        if ACT == 2:  # gelu_tanh, with 1 + tanh(y) = 2 - 2 / (exp(2y) + 1), clamped where it is 2 to an ulp
            z = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
            act = 0.5 * gf * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 40.0)) + 1.0))
        else:  # gelu
            act = 0.5 * gf * (1.0 + tl.math.erf(gf * 0.7071067811865476))
        y = act.to(g.dtype).to(tl.float32) * u.to(tl.float32)
    tl.store(out + t * s_ot + j, y.to(out.dtype.element_ty), mask=m)


@triton.jit
def gemv_kernel(
    x, w, bias, y, M, N, K, s_xm, s_wn, s_ym, res, res_out, norm_w, eps, s_rm, s_rom,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
    M_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N),): output features [pid * BLOCK_N, +BLOCK_N) for all M rows (layers/gemv.py).
    The first w tile is read before pdl_wait: under PDL it streams in while the kernel before runs."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    ms = tl.arange(0, M_P2)[:, None]  # [MP, 1] input rows
    ks = tl.arange(0, BLOCK_K)
    w_rows, n_ok = w + rows[:, None] * s_wn, rows[:, None] < N  # [BN, 1]
    w0 = tl.load(w_rows + ks[None, :], mask=n_ok & (ks[None, :] < K), other=0.0)  # [BN, BK]
    pdl_wait(PDL)
    acc = tl.zeros((M_P2, BLOCK_N), dtype=tl.float32)
    if NORM:  # one tile holds the whole row (BLOCK_K >= K): norm it, then one pass over w
        mk = (ms < M) & (ks[None, :] < K)
        h = tl.load(x + ms * s_xm + ks[None, :], mask=mk, other=0.0)  # [MP, BK]
        if HAS_RES:
            h = add_residual(h, tl.load(res + ms * s_rm + ks[None, :], mask=mk, other=0.0))
            if pid == 0:
                tl.store(res_out + ms * s_rom + ks[None, :], h, mask=mk)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 1) / K + eps)  # [MP]
        nw = tl.load(norm_w + ks, mask=ks < K, other=0.0)[None, :]
        xt = rms_norm_weighted(h, nw, rstd[:, None], False).to(h.dtype)
        acc += tl.sum(xt.to(tl.float32)[:, None, :] * w0.to(tl.float32)[None, :, :], axis=2)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            mk = (ms < M) & (kk[None, :] < K)
            wt = tl.load(w_rows + kk[None, :], mask=n_ok & (kk[None, :] < K) & (k0 > 0), other=0.0)
            wt = tl.where(k0 > 0, wt, w0)  # [BN, BK]; tile 0 was read before pdl_wait
            xt = tl.load(x + ms * s_xm + kk[None, :], mask=mk, other=0.0)  # [MP, BK]
            if SILU_MUL:  # x is [M, 2K]: gate, then up
                u = tl.load(x + ms * s_xm + K + kk[None, :], mask=mk, other=0.0)
                xt = silu_mul(xt, u).to(xt.dtype)
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + ms * s_ym + rows[None, :], acc.to(y.dtype.element_ty), mask=(ms < M) & (rows[None, :] < N))
