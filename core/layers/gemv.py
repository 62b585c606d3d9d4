"""A Triton GEMV for decode-sized batches: y [M, N] = x [M, K] @ w [N, K]^T (+ bias), M <= 8.

At batch 1 a decode step is a stream of weight reads: on the H200 the 141 cuBLAS matmuls of a
Qwen3-0.6B-shaped step took 907 us for 1.19 GB, about 30% of copy bandwidth
(benchmarks/results/2026-11-30-h200-profile-decode-b1-full.json). This kernel streams w once: each program
owns BLOCK_N output features and walks K in BLOCK_K chunks, all M rows against each loaded w tile, in
float32, rounded once at the end as cuBLAS does.

Off by default: it passes the float64 tests (tests/test_fused.py) under TRITON_INTERPRET=1 but has not
been timed on a GPU. TURNOUT_TRITON_GEMV=1 turns it on for linear layers; `benchmarks/bench_gemv.py`
compares it with F.linear at the model's shapes and sweeps its tile sizes.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

MAX_M = 8


@functools.cache
def switched_on() -> bool:
    """TURNOUT_TRITON_GEMV=1, read once: enabled() runs on every linear layer's call."""
    return os.environ.get("TURNOUT_TRITON_GEMV", "0") == "1"


def enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() sends this matmul here: CUDA, fp16/bf16, at most MAX_M rows, TURNOUT_TRITON_GEMV=1."""
    return (
        switched_on()
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] <= MAX_M
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
    )


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(
        x, w, bias, y, M, N, K, s_xm, s_wn, s_ym,
        HAS_BIAS: tl.constexpr, M_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Grid (cdiv(N, BLOCK_N),): output features [pid * BLOCK_N, +BLOCK_N) for all M rows."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
        ms = tl.arange(0, M_P2)  # [MP] input rows
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((M_P2, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            wt = tl.load(w + rows[:, None] * s_wn + kk[None, :], mask=(rows[:, None] < N) & (kk[None, :] < K),
                         other=0.0)  # [BN, BK]  # fmt: skip
            xt = tl.load(x + ms[:, None] * s_xm + kk[None, :], mask=(ms[:, None] < M) & (kk[None, :] < K),
                         other=0.0)  # [MP, BK]  # fmt: skip
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
        out = y + ms[:, None] * s_ym + rows[None, :]
        tl.store(out, acc.to(y.dtype.element_ty), mask=(ms[:, None] < M) & (rows[None, :] < N))

    return SimpleNamespace(gemv=gemv_kernel, next_power_of_2=triton.next_power_of_2)


def tiles(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the broadcast product holds M_P2 * BLOCK_N * BLOCK_K floats, so BLOCK_K
    shrinks as M grows; BLOCK_N stays small so that even N = 1024 gives every SM programs to run."""
    block_n = 4 if n <= 8192 else 8
    return block_n, max(64, 1024 // max(1, m)), 4


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_M
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tile: tuple[int, int, int] | None = None,  # (BLOCK_N, BLOCK_K, num_warps); default tiles(M, N)
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k, (x.shape, weight.shape)
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kern = _kernel()
    block_n, block_k, warps = tile or tiles(m, n)
    kern.gemv[(-(-n // block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, M_P2=kern.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps,
    )  # fmt: skip
    return y
