"""A Triton GEMV for decode batches: y [M, N] = x [M, K] @ w [N, K]^T (+ bias), the op before it fused in.

At batch 1 a decode step is a stream of weight reads, launched as ~320 small kernels. cuBLAS reads the
Qwen3-0.6B matmuls at about 20-30% of bandwidth there; this kernel streams w once (each program owns
BLOCK_N output features and walks K in BLOCK_K chunks, all M rows against each w tile, in float32, rounded
once at the end as cuBLAS does) and takes a batch-1 step's matmuls in 0.7x cuBLAS's time on an H200 at
M = 1 and 2 (`benchmarks/results/gemv/`); cuBLAS wins from M = 4, so linear layers route only
M <= MAX_M here. Its prologue can also do the op before the matmul, which saves that op's kernel and
launch gap:

- `norm`: RMSNorm(x [+ residual]) with the rounding of layers/fused.py's rms_norm (program 0 writes
  x + residual), when one BLOCK_K covers the row. An RMSNorm built with feeds_linear=True hands the
  next column-parallel linear a PendingNorm instead of running, and that linear passes it here;
- `silu_mul`: x is gate_up [M, 2K]; the GEMV reads silu(gate) * up, rounded as fused.silu_and_mul. A
  SiluAndMul built with feeds_linear=True hands the row-parallel linear after it a PendingSiluMul.

With both, a batch-1 FULL step of the shared decoder runs 236 kernels instead of 320, and its TPOT is
about a quarter lower than with cuBLAS on an H200.

The kernel is in layers/triton_kernels.py. TURNOUT_TRITON_GEMV=0 sends every matmul to F.linear. Tested
against float64 under TRITON_INTERPRET=1 (tests/test_fused.py); its sweeps against cuBLAS are the records in
`benchmarks/results/gemv/`, each naming the command and commit that made it.
"""

from __future__ import annotations

import functools

import torch

from turnout import envs
from turnout.layers import fused, pdl

MAX_M = 2  # rows routed here by enabled(); the kernel itself takes any M
# enabled() routes weight rows of at most TURNOUT_GEMV_MAX_K (default 3072) features here. On an H200 at
# batch 1 the GEMV wins at the Qwen3-0.6B rows (1024-3072) and loses at the 8B's (4096, 12288): its TPOT
# there was 6.24 ms against 4.77 with cuBLAS (benchmarks/results/latency/*-qwen3-8b-gemv-max-k-3072.json).
NORM_MAX_K = 4096  # a norm prologue holds M_P2 x BLOCK_N x K floats in registers


@functools.cache
def switched_on() -> bool:
    """TURNOUT_TRITON_GEMV (default 1), read once: enabled() runs on every linear layer's call."""
    return envs.TRITON_GEMV.value


@functools.cache
def max_k() -> int:
    """TURNOUT_GEMV_MAX_K, read once: the longest weight row sent here."""
    return envs.GEMV_MAX_K.value


def enabled(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether a linear layer sends x @ weight^T here: CUDA, the GEMV's shapes (fits), not switched off.
    Without weight: whether x's rows qualify, for the layers before one (a norm that hands a linear its
    prologue)."""
    return x.is_cuda and fits(x, weight) and switched_on()


def fits(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether x @ weight^T has the GEMV's shapes, on any device: fp16/bf16 (weight of the same dtype), at
    most MAX_M rows, a weight row of at most max_k() features."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_M
        and x.dtype in (torch.float16, torch.bfloat16)
        and (weight is None or (weight.dtype == x.dtype and weight.shape[1] <= max_k()))
    )


@functools.cache
def tile_overrides() -> dict[tuple[int, int], tuple[int, int]]:
    """TURNOUT_GEMV_TILES, read once: {(N, K): (BLOCK_N, num_warps)} that replace tiles()'s choice."""
    return envs.GEMV_TILES.value


def tiles(m: int, n: int, k: int, norm: bool = False, silu_mul: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), unless TURNOUT_GEMV_TILES names the shape. Up to NORM_MAX_K the whole
    row is one tile, so a program reads all its weights before gdc_wait (layers/pdl.py); longer rows go in
    tiles of 1024 / M_P2. From the H200 sweeps at M = 1 (benchmarks/results/gemv/, isolated and in a step):
    - two output features a program, so even N = 1024 gives every SM programs; 8 warps past BLOCK_K 2048,
      where the broadcast product holds M_P2 * BLOCK_N * BLOCK_K floats;
    - with silu_mul at M = 1, four on 4 warps: every program computes SiLU(gate) * up over the whole row
      again (at M = 2 that tile would hold twice the floats, and it was not measured there);
    - the LM head's 8 on 4 warps;
    - a whole row of 4096 (the 8B shapes: qkv, o, gate_up, the LM head): two on 4 warps, 64 weights a
      thread; the tiles above, which hold 128-256 there, spill (gate_up 131 against 65 us, the LM head
      703 against 338 us on an H200, benchmarks/results/gemv/, qwen3-8b)."""
    m_p2 = fused.kernels().next_power_of_2(m)
    block_k = fused.kernels().next_power_of_2(k) if norm or k <= NORM_MAX_K else max(64, 1024 // m_p2)
    if block_k >= NORM_MAX_K and not silu_mul:
        block_n, warps = 2, 4
    elif n > 8192:
        block_n, warps = 8, 4
    elif silu_mul and m_p2 == 1:
        block_n, warps = 4, 4
    else:
        block_n, warps = 2, (8 if block_k > 2048 else 4)
    block_n, warps = tile_overrides().get((n, k), (block_n, warps))
    return block_n, block_k, warps


def gemv(
    x: torch.Tensor,  # [M, K]; [M, 2K] (gate, up) with silu_mul
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tile: tuple[int, int, int] | None = None,  # (BLOCK_N, BLOCK_K, num_warps); default tiles()
    *,
    norm: tuple[torch.Tensor, float] | None = None,  # (weight [K], eps): y = RMSNorm(x [+ residual]) @ w^T
    residual: torch.Tensor | None = None,  # [M, K], only with norm
    residual_out: torch.Tensor | None = None,  # [M, K] contiguous: where x + residual goes (default: new)
    silu_mul: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # y [M, N]; with norm (y, x + residual or x)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert x.shape[1] == (2 * k if silu_mul else k) and not (norm and silu_mul), (x.shape, weight.shape)
    assert residual is None or norm is not None
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = x
    if residual is not None:
        res_out = residual_out if residual_out is not None else torch.empty_like(x)
    res = residual.contiguous() if residual is not None else x
    kern = fused.kernels()
    block_n, block_k, warps = tile or tiles(m, n, k, norm is not None, silu_mul)
    assert norm is None or block_k >= k, "a norm needs the whole row in one tile"
    kern.gemv_kernel[(-(-n // block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        res, res_out, norm[0] if norm else x, norm[1] if norm else 0.0, res.stride(0), res_out.stride(0),
        HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul,
        M_P2=kern.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl.launch(),
    )  # fmt: skip
    return (y, res_out) if norm is not None else y
