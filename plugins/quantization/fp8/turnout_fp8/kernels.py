"""The FP8 matmuls on CUDA: y [M, N] = x [M, K] @ dequant(w [N, K] e4m3)^T (+ bias), in x's dtype.

Three routes, chosen by rows M and the scale layout (`ROUTES`):
- "gemv" (decode): `fp8_gemv`, a Triton GEMV that streams the FP8 weights once (half the bytes of bf16)
  with x in float32, the scales applied per scale block or per row; no activation is quantized.
- "triton": x quantized per token or per 1 x bk group (`quant_fp8`, or the checkpoint's static input
  scale), then `fp8_gemm`, a Triton FP8 GEMM (block scales applied per K tile, row scales at the end). An
  input still to be computed (turnout.layers.PendingNorm, PendingSiluMul) is computed in the quantizing
  kernel (`norm_quant`, `silu_mul_quant`), which writes e4m3 and the scales, never the compute-dtype row.
- "cublas": x quantized likewise, then cuBLASLt's FP8 GEMM through torch._scaled_mm (row-wise scales, or
  1 x 128 by 128 x 128 block scaling).

Each accumulates in float32 and rounds once. No host sync: CUDA graphs capture all three.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from turnout.layers import PendingNorm, PendingSiluMul, rms_norm_row, silu_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GEMV_MAX_M = 1


@triton.jit
def _quant_kernel(x, q, s, stride_x, stride_q, stride_sm, stride_sg, K, GROUP, BLOCK: tl.constexpr):
    row, g = tl.program_id(0), tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v)), 1e-10) / 448.0
    qv = tl.clamp(v / scale, -448.0, 448.0)
    tl.store(q + row * stride_q + cols, qv.to(q.dtype.element_ty), mask=mask)
    tl.store(s + row * stride_sm + g * stride_sg, scale)


@triton.jit
def _quant_row(v, q, s, stride_sg, K, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Store row v [BLOCK] (float32, zero past K) as _quant_kernel does: e4m3 at q, the scale of each 1 x
    GROUP slice (GROUP divides BLOCK) at s + g * stride_sg."""
    groups: tl.constexpr = BLOCK // GROUP
    v2 = tl.reshape(v, (groups, GROUP))
    scale = tl.maximum(tl.max(tl.abs(v2), 1), 1e-10) / 448.0  # [groups]
    qv = tl.reshape(tl.clamp(v2 / scale[:, None], -448.0, 448.0), (BLOCK,))
    cols = tl.arange(0, BLOCK)
    tl.store(q + cols, qv.to(q.dtype.element_ty), mask=cols < K)
    g = tl.arange(0, groups)
    tl.store(s + g * stride_sg, scale, mask=g * GROUP < K)


@triton.jit
def _norm_quant_kernel(
    x, res, w, res_out, q, s, stride_x, stride_r, stride_ro, stride_q, stride_sm, stride_sg, K, eps,
    HAS_RES: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (M,): RMSNorm(x [+ res]) of one row as turnout's rms_norm kernel rounds it (x + res to res_out
    in x's dtype; the normed row in x's dtype), then quantized by _quant_row."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    xv = tl.load(x + row * stride_x + cols, mask=m, other=0.0)
    y = rms_norm_row(xv, res + row * stride_r, res_out + row * stride_ro, w, cols, K, eps, HAS_RES, False)
    y = y.to(xv.dtype).to(tl.float32)
    _quant_row(y, q + row * stride_q, s + row * stride_sm, stride_sg, K, GROUP, BLOCK)


@triton.jit
def _silu_mul_quant_kernel(
    x, q, s, stride_x, stride_q, stride_sm, stride_sg, K, GROUP: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Grid (M,): silu(gate) * up of one row of x = [gate | up] ([2K]) as turnout's act_and_mul kernel
    rounds it (SiLU rounded to x's dtype before the product, the product to x's dtype), then quantized."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    g = tl.load(x + row * stride_x + cols, mask=m, other=0.0)
    y = silu_mul(g, tl.load(x + row * stride_x + K + cols, mask=m, other=0.0)).to(g.dtype).to(tl.float32)
    _quant_row(y, q + row * stride_q, s + row * stride_sm, stride_sg, K, GROUP, BLOCK)


FUSED_MAX_K = 16384  # norm_quant and silu_mul_quant hold a row in one program's registers


def _quant_buffers(
    m: int, k: int, group: int, col_major: bool, rows: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, K] e4m3, scale [rows, K / group] float32), M-fastest scales where col_major; rows past M
    are zero with scale 1."""
    rows = rows or m
    n_groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=FP8, device=device)
    if col_major:
        s = torch.empty(n_groups, rows, dtype=torch.float32, device=device).t()
    else:
        s = torch.empty(rows, n_groups, dtype=torch.float32, device=device)
    if rows > m:
        q[m:].zero_()
        s[m:].fill_(1.0)
    return q, s


def quant_fp8(
    x: torch.Tensor, group: int | None = None, col_major: bool = False, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [rows, K] e4m3, scale [rows, K / group] float32): one scale per row (group None) or per
    1 x group slice, amax / 448; col_major lays the scales out M-fastest, as cuBLASLt's 1 x 128 scaling
    reads them. rows (default M) pads the result: rows past M are zero with scale 1."""
    m, k = x.shape
    group = group or k
    q, s = _quant_buffers(m, k, group, col_major, rows, x.device)
    block = triton.next_power_of_2(group)
    if m:
        _quant_kernel[(m, triton.cdiv(k, group))](
            x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1), k, group,
            BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return q, s


def fusable(x: PendingNorm | PendingSiluMul, group: int | None) -> bool:
    """Whether norm_quant / silu_mul_quant take x: a row of at most FUSED_MAX_K values, and per-token scales
    or power-of-two groups."""
    k = x.x.shape[1] // (2 if isinstance(x, PendingSiluMul) else 1)
    return k <= FUSED_MAX_K and (
        group is None or group & (group - 1) == 0 and group <= triton.next_power_of_2(k)
    )


def norm_quant(
    p: PendingNorm, group: int | None = None, col_major: bool = False, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_fp8(p.materialize(), ...) in one kernel, the same bits; x + residual goes to p.residual_out."""
    m, k = p.x.shape
    block = triton.next_power_of_2(k)
    q, s = _quant_buffers(m, k, group or k, col_major, rows, p.x.device)
    res = p.residual if p.residual is not None else p.x
    if m:
        _norm_quant_kernel[(m,)](
            p.x, res, p.weight, p.residual_out, q, s, p.x.stride(0), res.stride(0), p.residual_out.stride(0),
            q.stride(0), s.stride(0), s.stride(1), k, p.eps, HAS_RES=p.residual is not None,
            GROUP=group or block, BLOCK=block, num_warps=max(1, min(8, block // 256)),
        )  # fmt: skip
    return q, s


def silu_mul_quant(
    x: torch.Tensor, group: int | None = None, col_major: bool = False, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_fp8(silu_and_mul(x), ...) in one kernel, the same bits; x = [gate | up] [M, 2K]."""
    m, k = x.shape[0], x.shape[1] // 2
    block = triton.next_power_of_2(k)
    q, s = _quant_buffers(m, k, group or k, col_major, rows, x.device)
    if m:
        _silu_mul_quant_kernel[(m,)](
            x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1), k, GROUP=group or block, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return q, s


@triton.jit
def _gemm_kernel(
    a, a_s, b, b_s, c, M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
    BLOCKED: tl.constexpr, BN_SCALE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c [M, N] = a [M, K] @ b [N, K]^T, both e4m3. BLOCKED: a_s [M, K / BLOCK_K] and b_s
    [N / BN_SCALE, K / BLOCK_K] scale each K tile; else a_s [M] and b_s [N] scale the result."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # programs of GROUP_M row tiles share their B tiles in L2
    first_m = (pid // width) * GROUP_M
    rows = min(grid_m - first_m, GROUP_M)
    pid_m, pid_n = first_m + (pid % width) % rows, (pid % width) // rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = a + rm[:, None] * stride_am + rk[None, :]
    b_ptr = b + rn[None, :] * stride_bn + rk[:, None]
    sa_ptr, sb_ptr = a_s + rm * stride_asm, b_s + (rn // BN_SCALE) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            av = tl.load(a_ptr, mask=rm[:, None] < M, other=0.0)
            bv = tl.load(b_ptr, mask=rn[None, :] < N, other=0.0)
        else:
            k_left = K - kb * BLOCK_K
            av = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
            bv = tl.load(b_ptr, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
        if BLOCKED:
            sa = tl.load(sa_ptr + kb, mask=rm < M, other=0.0)
            sb = tl.load(sb_ptr + kb, mask=rn < N, other=0.0)
            acc += tl.dot(av, bv) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(av, bv, acc)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if not BLOCKED:
        sa = tl.load(sa_ptr, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr, mask=rn < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c + rm[:, None] * stride_cm + rn[None, :], acc.to(c.dtype.element_ty), mask=mask)


def gemm_tile(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows (BLOCK_K is one scale block, 128): among the
    fastest of the H200 sweeps in results/fp8/ at the Qwen3-8B shapes up to M = 256 (none faster with
    split K), and a large tile beyond."""
    m_p2 = triton.next_power_of_2(max(m, 16))
    return (m_p2, 64, 4, 4) if m_p2 <= 64 else (64, 64, 4, 4) if m_p2 <= 256 else (128, 128, 8, 3)


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """xq [M, K] e4m3 @ w [N, K] e4m3 -> [M, N] of dtype. block (bn, bk): xs [M, K / bk] and ws
    [N / bn, K / bk]; else xs [M, 1] per row and ws [N] per output feature. tile overrides gemm_tile."""
    (m, k), n = xq.shape, w.shape[0]
    block_m, block_n, warps, stages = tile or gemm_tile(m)
    block_k = block[1] if block else 128
    c = torch.empty(m, n, dtype=dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        xq, xs, w, ws, c, m, n, k, xq.stride(0), w.stride(0), c.stride(0), xs.stride(0),
        ws.stride(0) if block else 1,
        BLOCKED=block is not None, BN_SCALE=block[0] if block else 1, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


@triton.jit
def _gemv_kernel(
    x, w, s, y, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
    BLOCKED: tl.constexpr, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
    M_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, BLOCK_N),): output features [pid * BLOCK_N, +BLOCK_N) for all M rows, w read once,
    STAGES tiles in flight. Products accumulate elementwise over K and are summed once at the end. Block
    scales: BLOCK_N divides BN_SCALE and BLOCK_K divides BK_SCALE, so one scale covers a tile and
    multiplies x, not every weight."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_P2)[:, None]
    ks = tl.arange(0, BLOCK_K)
    s_row = s + (pid * BLOCK_N // BN_SCALE) * stride_sn
    acc = tl.zeros((M_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + ks
        wm = (rn[:, None] < N) & (kk[None, :] < K)
        wv = tl.load(w + rn[:, None] * stride_wn + kk[None, :], mask=wm, other=0.0).to(tl.float32)
        xv = tl.load(x + rm * stride_xm + kk[None, :], mask=(rm < M) & (kk[None, :] < K), other=0.0)
        xv = xv.to(tl.float32)
        if BLOCKED:
            xv = xv * tl.load(s_row + k0 // BK_SCALE)
        acc += xv[:, None, :] * wv[None, :, :]
    out = tl.sum(acc, axis=2)
    if not BLOCKED:
        out = out * tl.load(s + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y + rm * stride_ym + rn[None, :], out.to(y.dtype.element_ty), mask=(rm < M) & (rn[None, :] < N))


def gemv_tiles(m: int, block: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the accumulator holds M_P2 x BLOCK_N x BLOCK_K floats, 64 a
    thread up to 64 rows. At M = 1, the fastest of an H100 sweep over every linear of a 36-layer Qwen3-8B
    stack in one CUDA graph (results/fp8/*-gemv-stages.json): 8 x 512 tiles on 2 warps, 3 in flight, for row
    scales; 8 x 128 (one scale block wide) on 2 warps, 6 in flight, for block scales."""
    m_p2 = triton.next_power_of_2(m)
    block_k = min(128, max(16, 8192 // m_p2)) if block else max(16, 512 // m_p2)
    return max(1, min(8, 4096 // (m_p2 * block_k))), block_k, 2, 6 if block else 3


def fp8_gemv(
    x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int] | None, tile=None
) -> torch.Tensor:
    """x [M, K] (compute dtype) @ dequant(w)^T -> [M, N] in x's dtype; ws [N] per row, or [N / bn, K / bk]
    per block; tile overrides gemv_tiles."""
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = tile or gemv_tiles(m, block)
    bn, bk = block or (block_n, block_k)
    block_n, block_k = math.gcd(block_n, bn), math.gcd(block_k, bk)  # one scale block a tile
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, ws, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), ws.stride(0),
        BLOCKED=block is not None, BN_SCALE=bn, BK_SCALE=bk, M_P2=triton.next_power_of_2(m), BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


# The fastest route by rows M, per scale layout: (largest M, route), first match. Every bound is a CUDA-graph
# capture size, so a batch padded for its graph takes the route its eager run takes (the graph-mode identity
# tests). From the H200 sweeps in results/fp8/, summed over the Qwen3-8B linears, each timed inside a CUDA
# graph over weights beyond L2 (us; bf16 cuBLAS: 120 at M = 1, 110-124 up to 128, 157 at 256): "gemv" 91
# (channel) / 98 (block) at M = 1; "triton" (fp8_gemm) 98-110 from 4 to 64 rows (channel), 107 at M = 2
# (block); "cublas" (_scaled_mm) 109 at 128 and 123 at 256 (channel), 92-122 from 4 to 128 (block), and the
# least from 256 rows on.
ROUTES: dict[str, list[tuple[int, str]]] = {
    "channel": [(GEMV_MAX_M, "gemv"), (64, "triton"), (1 << 62, "cublas")],
    "block": [(GEMV_MAX_M, "gemv"), (2, "triton"), (1 << 62, "cublas")],
}


def route(m: int, n: int, k: int, block: tuple[int, int] | None, device: torch.device) -> str:
    """The route fp8_linear takes for M rows of an [N, K] weight: ROUTES' entry, with "triton" for block
    scales that cuBLASLt cannot take (blocks other than 128 x 128, or N or K not a multiple of them)."""
    r = next(r for top, r in ROUTES["channel" if block is None else "block"] if m <= top)
    if r == "cublas" and block is not None:
        fits = block == (128, 128) and n % 128 == 0 and k % 128 == 0
        return "cublas" if fits and cublas_block_scaling(device.index or 0) else "triton"
    return r


@functools.cache
def cublas_block_scaling(device_index: int) -> bool:
    """Whether torch._scaled_mm takes 1 x 128 by 128 x 128 block scales on this GPU (cuBLASLt 12.9 and
    later on Hopper). Asked once per device, at load (never while a CUDA graph is captured)."""
    dev = torch.device("cuda", device_index)
    a = torch.zeros(256, 256, device=dev, dtype=FP8)
    sa, sb = torch.ones(2, 256, device=dev).t(), torch.ones(2, 2, device=dev).t()
    try:
        torch._scaled_mm(a, a.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fp8_linear(
    x: torch.Tensor | PendingNorm | PendingSiluMul,
    w: torch.Tensor,
    ws: torch.Tensor,
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The FP8 linear layer's forward by `route`; input_scale [1, 1] for static activations (per-channel
    scales only). x may be a norm or SiLU-and-mul still to be computed: the routes that quantize dynamically
    compute it in their quant kernel where `fusable`; otherwise it is materialized first."""
    rows_x = x.x if isinstance(x, (PendingNorm, PendingSiluMul)) else x  # [M, ...] in the compute dtype
    m, group = rows_x.shape[0], block[1] if block is not None else None
    r = route(m, *w.shape, block, rows_x.device)
    if rows_x is not x and (r == "gemv" or input_scale is not None or not fusable(x, group)):
        x = x.materialize()
    if r == "gemv":
        y = fp8_gemv(x.contiguous(), w, ws, block)
    else:
        xq, xs = _quantize(x, m, r == "cublas" and group is not None, group, input_scale)
        if r == "cublas":  # block scales: cuBLASLt's 1 x 128 by 128 x 128 scaling (CUDA 12.9 and later)
            scale_b = ws.t() if block is not None else ws.view(1, -1)
            y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale_b, out_dtype=rows_x.dtype)[:m]
        else:
            y = fp8_gemm(xq, xs, w, ws, block, rows_x.dtype)
    return y if bias is None else y + bias


def _quantize(
    x: torch.Tensor | PendingNorm | PendingSiluMul,
    m: int,
    col_major: bool,
    group: int | None,
    input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x's e4m3 rows and scales for the GEMM routes; col_major (cuBLASLt's M-major 1 x 128 scales) pads the
    rows to 4, as those scales need 16-byte rows."""
    rows = -(-m // 4) * 4 if col_major else m
    if isinstance(x, PendingNorm):
        return norm_quant(x, group, col_major, rows)
    if isinstance(x, PendingSiluMul):
        return silu_mul_quant(x.x, group, col_major, rows)
    if input_scale is not None:
        xq = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return xq, input_scale.expand(m, 1).contiguous()
    return quant_fp8(x.contiguous(), group, col_major, rows)
