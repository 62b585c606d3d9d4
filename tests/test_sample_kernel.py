"""The one-pass sampling kernel (worker/sample_kernel.py) against float64 references: greedy rows against
argmax, ties included, and drawn rows against softmax(x / T) by a chi-square test. Off CUDA it runs under
TRITON_INTERPRET=1."""

from __future__ import annotations

import math

import pytest
import torch

from turnout.sampling_params import SamplingParams
from turnout.worker import sample_kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpreter(triton_kernels) -> None:
    triton_kernels(sample_kernel._kernel)


@pytest.mark.parametrize("programs", [6, 512], ids=["one-split-of-4-blocks", "4-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_rows_are_argmax_first_on_ties_across_blocks(dtype, programs, monkeypatch):
    monkeypatch.setattr(sample_kernel, "BLOCK", 16)  # a vocabulary of 4 blocks
    monkeypatch.setattr(sample_kernel, "PROGRAMS", programs)  # 6 rows: 1 split a row, or 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g).to(dtype)
    logits[1, [3, 40]] = 9.0  # a tie inside the first block and in a later one
    logits[2, [17, 33]] = 9.0  # a tie between two later blocks
    logits[3] = 0.0  # every entry ties
    wide = torch.zeros(6, 64, dtype=dtype)
    wide[:, :50] = logits
    for x in (logits, wide[:, :50]):  # contiguous, and rows strided
        out = sample_kernel.gumbel_argmax(x.to(DEV), torch.zeros(6, device=DEV))
        assert out.cpu().tolist() == logits.double().argmax(-1).tolist()
        assert out.cpu().tolist()[1:4] == [3, 17, 0]


@pytest.mark.slow
def test_drawn_rows_follow_softmax_over_temperature():
    """1024 draws from one distribution (rows of the same logits) against softmax(x / T) in float64; a
    masked (-inf) entry is never drawn."""
    torch.manual_seed(0)
    if DEV == "cuda":
        torch.cuda.manual_seed(0)
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5, 0.25, 3.0])
    t = 0.7
    rows = 1024
    out = sample_kernel.gumbel_argmax(x.expand(rows, -1).to(DEV), torch.full((rows,), t, device=DEV))
    counts = torch.bincount(out.cpu(), minlength=x.numel()).double()
    p = torch.softmax(x.double() / t, -1)
    assert counts[5] == 0
    keep = p > 0
    chi2 = (((counts - rows * p)[keep]) ** 2 / (rows * p[keep])).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, counts.tolist(), (rows * p).tolist())


def test_mixed_greedy_and_drawn_rows_and_fresh_draws_per_call():
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(1)).to(DEV)
    temps = torch.tensor([0.0, 1.0] * 32, device=DEV)
    a, b = (sample_kernel.gumbel_argmax(x, temps).cpu() for _ in range(2))
    assert a[0::2].tolist() == b[0::2].tolist() == x[0::2].argmax(-1).cpu().tolist()
    assert a[1::2].tolist() != b[1::2].tolist()  # 32 rows of 100 near-uniform choices: equal by chance ~0


def test_batches_it_takes():
    x = torch.zeros(2, 100)
    plain = [SamplingParams(temperature=0.6), SamplingParams(temperature=0)]
    assert sample_kernel.can_sample(x, plain, seeded=False) is False  # off CUDA: the torch path
    if DEV == "cuda":
        xc = x.to(DEV)
        assert sample_kernel.can_sample(xc, plain, seeded=False)
        assert not sample_kernel.can_sample(xc, plain, seeded=True)
        for kw in (
            {"top_p": 0.9},
            {"top_k": 5},
            {"min_p": 0.1},
            {"repetition_penalty": 1.2},
            {"min_tokens": 2},
        ):
            assert not sample_kernel.can_sample(xc, [SamplingParams(temperature=0.6, **kw)], seeded=False)
        assert sample_kernel.can_sample(xc, [SamplingParams(temperature=0.6, top_k=100)], seeded=False)
