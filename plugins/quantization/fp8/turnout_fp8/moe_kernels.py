"""Fused MoE experts computed from FP8 weights: a Triton grouped GEMM over the (token, expert) pairs that
turnout.layers.moe_align sorts by expert, whose expert weights stay e4m3 in memory and are dequantized
one K tile at a time inside the kernel; activations stay in the compute dtype, products accumulate in
float32.

Scales (float32, E: the experts this rank holds, N x K: one expert's weight):
- per row ([E, N]; a per-tensor scale fills its rows): the tile products accumulate unscaled and each
  output column is multiplied by its row's scale once, at the end;
- per bn x bk block ([E, ceil(N / bn), ceil(K / bk)]): each K tile lies inside one block column (the
  kernel's BLOCK_K divides bk), so its product is multiplied by the scale of each output column's block
  before it is added.
Such a grouped GEMM reads each expert's weight bytes once a tile row, half of what a bfloat16 copy takes.
Off CUDA it runs under TRITON_INTERPRET=1 only (the tests); the CPU dequantizes the experts at load."""

from __future__ import annotations

import functools
import os

import torch

from turnout.layers import SiluAndMul, moe_align

_act = SiluAndMul()


def kernel_fits(block: tuple[int, int] | None, rows_per_part: int) -> bool:
    """Whether the kernel takes these expert scales: per-row scales always; blocks where bk is a power of
    two of at least 16 (a K tile must lie in one block column) and each of w13's two parts (gate, up:
    rows_per_part rows) starts on a block row."""
    if block is None:
        return True
    bn, bk = block
    return bk >= 16 and bk & (bk - 1) == 0 and rows_per_part % bn == 0


@functools.cache
def _kernel():
    """The @triton.jit kernel, built on first use so that importing the plugin never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_moe_gemm_kernel(
        a, w, s, c, sorted_ids, expert_ids, num_post_padded, N, K, num_pairs,
        s_am, s_we, s_wn, s_cm, s_se, s_sn, s_sk,
        A_DIV: tl.constexpr, BLOCK_SCALES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Grid (blocks of sorted pairs, cdiv(N, BLOCK_N)): c[pair] = a[pair // A_DIV] @ (w[e] * scale)^T
        for the BLOCK_M pairs of one expert e; padding entries (== num_pairs) load zeros and store nothing.
        UPCAST: both operands in float32 with IEEE dots (float32 activations, and the interpreter)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_post_padded):
            return
        pairs = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = pairs // A_DIV
        e = tl.load(expert_ids + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                a + rows[:, None] * s_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
            )
            wq = tl.load(
                w + e * s_we + cols[None, :] * s_wn + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N] e4m3: w[e] read transposed
            if UPCAST:
                part = tl.dot(x.to(tl.float32), wq.to(tl.float32), input_precision="ieee")
            else:  # e4m3 is exact in bfloat16 and float16
                part = tl.dot(x, wq.to(x.dtype))
            if BLOCK_SCALES:
                sc = tl.load(s + e * s_se + (cols // BN) * s_sn + (k0 // BK) * s_sk, mask=cols < N, other=0.0)
                acc += part * sc[None, :]
            else:
                acc += part
        if not BLOCK_SCALES:
            acc = acc * tl.load(s + e * s_se + cols * s_sn, mask=cols < N, other=0.0)[None, :]
        out = c + pairs[:, None] * s_cm + cols[None, :]
        tl.store(out, acc.to(c.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))

    return fp8_moe_gemm_kernel, os.environ.get("TRITON_INTERPRET") == "1"


def tiles(num_pairs: int, num_experts: int, block: tuple[int, int] | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): BLOCK_M by the pairs an expert gets on average (a block reads its
    expert's whole weight slice, so short runs take short blocks); BLOCK_K at most the scale block's bk."""
    per_expert = num_pairs / max(num_experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    bk = 64 if bm < 64 else 32
    return bm, 64, min(bk, block[1]) if block else bk


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pairs: int,
    a_div: int,
    tile: tuple[int, int, int],
) -> torch.Tensor:
    """[num_pairs, N] (a's dtype) = a[pair // a_div] @ (w[expert of pair] * scale)^T; w [E, N, K] e4m3,
    scale [E, N] per row or [E, ceil(N / bn), ceil(K / bk)] per block."""
    sorted_ids, expert_ids, num_post_padded = align
    bm, bn, bk = tile
    n, k = w.shape[1], w.shape[2]
    c = a.new_empty(num_pairs, n)
    kernel, interpret = _kernel()
    s_sk = scale.stride(2) if block else 0
    sbn, sbk = block or (1, 1)
    kernel[(sorted_ids.numel() // bm, -(-n // bn))](
        a, w, scale, c, sorted_ids, expert_ids, num_post_padded, n, k, num_pairs,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), scale.stride(0), scale.stride(1), s_sk,
        A_DIV=a_div, BLOCK_SCALES=block is not None, BN=sbn, BK=sbk,
        UPCAST=interpret or a.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip
    return c


def fp8_expert_outputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    block: tuple[int, int] | None,
) -> torch.Tensor:
    """x [T, H] (compute dtype), w13 [E, 2I, H] and w2 [E, H, I] e4m3 with their scales (grouped_gemm's
    layouts), topk_ids [T, k] -> pair outputs [T * k, H]: row t * k + j is w2[e] silu-and-mul(w13[e] x[t])
    for e = topk_ids[t, j], as turnout.layers.moe's kernels give them."""
    p, k = topk_ids.numel(), topk_ids.shape[1]
    if p == 0:
        return x.new_empty(0, w2.shape[1])
    tile = tiles(p, w13.shape[0], block)
    align = moe_align(topk_ids, w13.shape[0], tile[0])
    h = grouped_gemm(x.contiguous(), w13, w13_scale, block, align, p, k, tile)  # [P, 2I]
    return grouped_gemm(_act(h), w2, w2_scale, block, align, p, 1, tile)  # [P, H]
