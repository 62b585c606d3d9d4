"""Temperature sampling in one pass over the logits (Triton), for batches with no top-k, top-p, min-p,
seeded generator or logits processing: the common case of a serving batch.

sampler.sample draws by the exponential race, argmax_i probs_i / q_i with q_i ~ Exp(1); with
probs = softmax(x / T) that is the Gumbel-max trick, argmax_i x_i / T - log(q_i). The logits are read
once, in their own dtype, each program keeping a running (key, index) maximum over its share of a row,
where the torch path makes about ten passes over a float32 copy. A row with temperature 0 takes
argmax_i x_i, the first on ties, as torch.argmax does. The uniforms come from Philox, keyed by a seed
drawn from torch's CUDA generator on the device, so the launch never syncs with the host and
`torch.manual_seed` still fixes the draws.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from turnout.layers import fused
from turnout.sampling_params import SamplingParams

BLOCK = 2048  # vocabulary entries per iteration of a program
PROGRAMS = 512  # programs to aim for: a row's vocabulary is split so that batch 1 fills the GPU too


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gumbel_argmax_kernel(
        logits, temps, seed_ptr, keys, idxs, s_row, vocab, per_split, BLOCK: tl.constexpr
    ):  # fmt: skip
        """Grid (B, splits): the best (key, index) of row b over [s * per_split, (s + 1) * per_split)."""
        row, split = tl.program_id(0), tl.program_id(1)
        temp = tl.load(temps + row)
        seed = tl.load(seed_ptr)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, vocab)
        cols = tl.arange(0, BLOCK)
        best_key = tl.full((), float("-inf"), tl.float32)
        best_idx = lo
        for start in range(lo, hi, BLOCK):
            j = start + cols
            m = j < hi
            x = tl.load(logits + row * s_row + j, mask=m, other=float("-inf")).to(tl.float32)
            if temp > 0:
                u = tl.rand(seed, row * vocab + j)  # [0, 1); u = 0 gives key -inf: never drawn
                x = x / temp - tl.log(-tl.log(u))
            x = tl.where(m, x, float("-inf"))
            k = tl.max(x, 0)
            i = tl.argmax(x, 0, tie_break_left=True) + start
            better = k > best_key  # strictly: an earlier block keeps a tie
            best_idx = tl.where(better, i, best_idx)
            best_key = tl.where(better, k, best_key)
        out = row * tl.num_programs(1) + split
        tl.store(keys + out, best_key)
        tl.store(idxs + out, best_idx.to(tl.int64))

    return gumbel_argmax_kernel


def can_sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeded: bool) -> bool:
    """Whether gumbel_argmax draws this batch as the torch path would: on CUDA with the fused kernels on,
    no seeded row, no row whose logits are processed first, and none that filters its distribution."""
    vocab = logits.shape[1]
    plain = all(
        not p.needs_processing and (p.greedy or (not 0 < p.top_k < vocab and p.top_p >= 1 and p.min_p <= 0))
        for p in params
    )
    return fused.enabled(logits) and not seeded and plain and logits.shape[0] * vocab < 2**31


def gumbel_argmax(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (rows may be strided, any float dtype), temps [B] float32 (0: greedy) -> [B] int64.
    Each split's best, then the first best split of each row: ties go to the lowest index, as in argmax."""
    b, vocab = logits.shape
    if not b:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    blocks = -(-vocab // BLOCK)
    splits = max(1, min(blocks, PROGRAMS // b))
    per_split = -(-blocks // splits) * BLOCK
    splits = -(-vocab // per_split)
    keys = torch.empty(b, splits, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(b, splits, dtype=torch.int64, device=logits.device)
    seed = torch.randint(2**31 - 1, (1,), device=logits.device, dtype=torch.int64)
    _kernel()[(b, splits)](
        logits, temps, seed, keys, idxs, logits.stride(0), vocab, per_split, BLOCK=BLOCK, num_warps=8
    )
    return idxs.gather(1, keys.argmax(1, keepdim=True))[:, 0]
