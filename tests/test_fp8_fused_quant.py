"""turnout-fp8's fused input quantization: the RMSNorm or SiLU-and-mul that feeds an FP8 linear, computed in
the kernel that quantizes it (`norm_quant`, `silu_mul_quant`), against the two kernels it replaces
(turnout's fused rms_norm or silu_and_mul, then quant_fp8: the same bits) and against a float64 reference
of the norm or activation, within e4m3's rounding. Off CUDA the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from turnout.layers import PendingNorm, PendingSiluMul, fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_REL = 2.0**-4 + 2.0**-8  # e4m3's rounding (3 mantissa bits) and the compute dtype's before it


@pytest.fixture
def kn(triton_kernels):
    """turnout_fp8.kernels, and turnout's fused kernels, built for the interpreter off CUDA."""
    triton_kernels(fused.kernels)
    from turnout_fp8 import kernels

    return kernels if torch.cuda.is_available() else importlib.reload(kernels)


def _groups(t: torch.Tensor, s: torch.Tensor, group: int | None) -> torch.Tensor:
    """The scales s [M, groups] spread over t's [M, K] columns."""
    k = t.shape[1]
    return s.double().repeat_interleave(group or k, 1)[:, :k]


def _check_dequantized(q: torch.Tensor, s: torch.Tensor, ref: torch.Tensor, group: int | None) -> None:
    """Each scale is its slice's float64 amax / 448, to two roundings of the compute dtype; on CUDA, q * scale
    is ref to e4m3's rounding. The interpreter truncates where CUDA rounds to nearest (twice the bf16 error)
    and its float-to-e4m3 cast puts some values in the wrong binade (124.3 to 64), so off CUDA the scales
    get twice the tolerance and q is checked only against the unfused kernels, which share those casts."""
    m = ref.shape[0]
    amax = torch.stack([c.abs().amax(-1) for c in ref.split(group or ref.shape[1], 1)], 1)
    rtol = 2.0**-7 if DEV == "cuda" else 2.0**-6
    torch.testing.assert_close(s[:m].double(), amax / 448, rtol=rtol, atol=0)
    if DEV == "cpu":
        return
    scale = _groups(q, s[:m], group)
    err = (q.double() * scale - ref).abs()
    bound = E4M3_REL * ref.abs() + scale * 2.0**-9  # e4m3 subnormals: steps of 2^-9 under the scale
    assert bool((err <= bound).all()), float((err - bound).max())


CASES = [  # K, group (None: a scale a row), col_major and padded rows (cuBLASLt's 1 x 128 layout)
    pytest.param(256, None, False, id="row-256"),
    pytest.param(320, None, False, id="row-320"),
    pytest.param(256, 64, False, id="group64"),
    pytest.param(320, 64, True, id="group64-colmajor-320"),
]


@pytest.mark.parametrize("k,group,col_major", CASES)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_quant_is_rms_norm_then_quant(kn, k: int, group, col_major: bool, residual: bool) -> None:
    torch.manual_seed(k + (group or 0))
    m, eps = 5, 1e-6
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16) * 3
    res = torch.randn(m, k, device=DEV).to(torch.bfloat16) if residual else None
    w = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16)
    rows = 8 if col_major else None
    if res is None:
        normed, res_sum = fused.rms_norm(x, w, eps), x
    else:
        normed, res_sum = fused.rms_norm(x, w, eps, res)
    want_q, want_s = kn.quant_fp8(normed, group, col_major, rows)
    pending = PendingNorm(x, res, w, eps, x if res is None else torch.empty_like(x))
    assert kn.fusable(pending, group)
    q, s = kn.norm_quant(pending, group, col_major, rows)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s) and s.stride() == want_s.stride()
    assert torch.equal(pending.residual_out, res_sum)
    h = res_sum.double()
    ref = w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    _check_dequantized(q[:m], s, ref, group)


@pytest.mark.parametrize("k,group,col_major", CASES)
def test_silu_mul_quant_is_silu_and_mul_then_quant(kn, k: int, group, col_major: bool) -> None:
    torch.manual_seed(k + (group or 0))
    m = 5
    x = (torch.randn(m, 2 * k, device=DEV) * 2).to(torch.bfloat16)
    rows = 8 if col_major else None
    want_q, want_s = kn.quant_fp8(fused.silu_and_mul(x), group, col_major, rows)
    assert kn.fusable(PendingSiluMul(x), group)
    q, s = kn.silu_mul_quant(x, group, col_major, rows)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)
    gate, up = x.double().chunk(2, -1)
    _check_dequantized(q[:m], s, F.silu(gate) * up, group)


def test_rows_past_fused_max_k_are_not_fusable(kn) -> None:
    """A row longer than one program holds goes the unfused way (materialized, then quant_fp8)."""
    wide = torch.zeros(1, 2 * (kn.FUSED_MAX_K + 128), dtype=torch.bfloat16)
    assert not kn.fusable(PendingSiluMul(wide), None)
    assert kn.fusable(PendingSiluMul(wide[:, : 2 * kn.FUSED_MAX_K]), 128)
    assert not kn.fusable(PendingSiluMul(wide[:, :512]), 96)  # groups of a power of two only


@pytest.mark.parametrize("m", [3, 80])
def test_fp8_linear_on_a_pending_norm_gives_the_materialized_bits(kn, m: int) -> None:
    """fp8_linear on a PendingNorm (the quant computing the norm) equals it on the norm materialized, for
    per-channel FP8 weights: the Triton FP8 GEMM at 3 rows, cuBLASLt's at 80 on CUDA."""
    if m > 64 and DEV == "cpu":
        pytest.skip("cuBLASLt's FP8 GEMM needs CUDA")
    torch.manual_seed(m)
    k, n = 256, 128
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    res = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    w = torch.ones(k, device=DEV, dtype=torch.bfloat16)
    wf = torch.randn(n, k, device=DEV) / k**0.5
    ws = wf.abs().amax(1) / 448
    wq = (wf / ws[:, None]).to(torch.float8_e4m3fn)
    eager = PendingNorm(x, res, w, 1e-6, torch.empty_like(x))
    want = kn.fp8_linear(eager.materialize(), wq, ws, None, None, None)
    pending = PendingNorm(x, res, w, 1e-6, torch.empty_like(x))
    got = kn.fp8_linear(pending, wq, ws, None, None, None)
    assert torch.equal(got, want)
    assert torch.equal(pending.residual_out, eager.residual_out)
