"""layers/gemv.py's Triton GEMV against a float64 reference (TRITON_INTERPRET=1 off CUDA) and, on CUDA,
against F.linear; and linear()'s routing to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnout.layers import gemv
from turnout.layers.linear import linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch):
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gemv._kernel.cache_clear()
    yield
    gemv._kernel.cache_clear()


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    return x, w, b, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k,bias", [(64, 96, False), (37, 300, True), (130, 64, False)])
def test_gemv_matches_float64(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    """Ragged N and K (masks), M not a power of two, bias: every output within the dtype's rounding."""
    x, w, b, ref = _case(m, n, k, dtype, bias, seed=m * n + k)
    y = gemv.gemv(x, w, b, tile=(4, 64, 4))  # BLOCK_K below K: the K loop runs several times
    assert y.shape == (m, n) and y.dtype == dtype
    eps = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ((y.double() - ref).abs() <= 2 * eps * ref.abs() + 1e-2).all()  # one rounding + the interpreter's
    if DEV == "cuda":
        assert ((y.double() - F.linear(x, w, b).double()).abs() <= 2 * eps * ref.abs() + 1e-3).all()


def test_linear_routes_small_cuda_batches_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, _, _ = _case(2, 16, 32, torch.bfloat16, False)
    monkeypatch.delenv("TURNOUT_TRITON_GEMV", raising=False)
    assert not gemv.enabled(x, w)  # off by default: not yet timed on a GPU
    monkeypatch.setenv("TURNOUT_TRITON_GEMV", "1")
    assert gemv.enabled(x, w) == x.is_cuda
    assert not gemv.enabled(torch.cat([x] * 5), w)  # 10 rows > MAX_M
    assert not gemv.enabled(x.float(), w.float())
    if DEV == "cuda":
        assert torch.equal(linear(x, w, None, None), gemv.gemv(x, w))
