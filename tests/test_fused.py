"""The Triton kernels of layers/fused.py and layers/gemv.py against a float64 reference and against the torch
path they replace on CUDA. Off CUDA they run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnout.layers import fused, gemv
from turnout.layers.activation import SiluAndMul
from turnout.layers.linear import linear
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch):
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused._kernels.cache_clear()
    gemv._kernel.cache_clear()
    yield
    fused._kernels.cache_clear()
    gemv._kernel.cache_clear()


def _tol(dtype: torch.dtype) -> float:
    # the interpreter has no bfloat16: it truncates where CUDA rounds to nearest, so its error is biased
    bf16 = 1e-2 if DEV == "cuda" else 2e-2
    return {torch.float32: 1e-5, torch.bfloat16: bf16, torch.float16: 2e-3}[dtype]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _ref_rope(x: torch.Tensor, pos: torch.Tensor, rot: RotaryEmbedding) -> torch.Tensor:  # x [T, H, D] f64
    cos, sin = rot.cos[pos].double()[:, None], rot.sin[pos].double()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(DEV, dtype)
    res = torch.randn(7, hidden, generator=g).to(DEV, dtype)
    norm = RMSNorm(hidden, 1e-6).to(DEV)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden, generator=g)).to(DEV, dtype)
    out = fused.rms_norm(x, norm.weight, norm.eps)
    assert _rel(out, _ref_norm(x, norm.weight, norm.eps)) < _tol(dtype)
    out, new_res = fused.rms_norm(x, norm.weight, norm.eps, res)
    if DEV == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(new_res, x + res)  # the residual add rounds like torch's
    assert _rel(out, _ref_norm(x.double() + res.double(), norm.weight, norm.eps)) < _tol(dtype)
    if DEV == "cuda":  # the interpreter's bf16 truncates: compare on CUDA
        eager = norm._norm(x + res)  # the torch path the CPU runs
        assert (out.float() - eager.float()).abs().max() <= 2 * eager.float().abs().max() * _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("head", [64, 48])
def test_qk_norm_rope_from_packed_qkv(dtype: torch.dtype, qk_norm: bool, head: int) -> None:
    t, hq, hkv = 5, 4, 2
    g = torch.Generator().manual_seed(head + qk_norm)
    qkv_wide = torch.randn(t, (hq + 2 * hkv) * head + 8, generator=g).to(DEV, dtype)
    qkv = qkv_wide[:, 8:]  # strided rows, as a slice of a wider GEMM output would be
    pos = torch.tensor([0, 3, 17, 200, 511], device=DEV)
    rot = RotaryEmbedding(head, 512, 10000.0, None).to(DEV)
    qn, kn = RMSNorm(head, 1e-6).to(DEV), RMSNorm(head, 1e-6).to(DEV)
    qn.weight.data = (1 + 0.3 * torch.randn(head, generator=g)).to(DEV, dtype)
    kn.weight.data = (1 + 0.3 * torch.randn(head, generator=g)).to(DEV, dtype)
    w = (qn.weight, kn.weight) if qk_norm else (None, None)
    q, k = fused.qk_norm_rope(qkv, pos, hq, hkv, rot.cos, rot.sin, *w, 1e-6)
    assert q.shape == (t, hq, head) and k.shape == (t, hkv, head) and q.is_contiguous()

    q_in = qkv[:, : hq * head].reshape(t, hq, head)
    k_in = qkv[:, hq * head : (hq + hkv) * head].reshape(t, hkv, head)
    q_ref, k_ref = q_in.double(), k_in.double()
    if qk_norm:
        q_ref, k_ref = _ref_norm(q_in, qn.weight, 1e-6), _ref_norm(k_in, kn.weight, 1e-6)
    assert _rel(q, _ref_rope(q_ref, pos, rot)) < _tol(dtype)
    assert _rel(k, _ref_rope(k_ref, pos, rot)) < _tol(dtype)
    if not qk_norm and (DEV == "cuda" or dtype != torch.bfloat16):  # the eager path, to an ulp or so
        q_eager, k_eager = rot(pos, q_in, k_in)
        # where x1 cos and x2 sin nearly cancel, an ulp of the products is a large part of the result:
        # measure the difference in ulps of the inputs' scale (the GPU compiler may fuse a multiply-add)
        ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
        for a, b, x in ((q, q_eager, q_in), (k, k_eager, k_in)):
            scale = x.float().abs().amax(-1, keepdim=True)  # [T, H, 1]
            assert ((a.float() - b.float()).abs() <= 2 * ulp * scale).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2 * 1500, generator=g).to(DEV, dtype)  # 1500 > one 1024-wide program
    out = fused.silu_and_mul(x)
    ref = torch.nn.functional.silu(x[:, :1500].double()) * x[:, 1500:].double()
    assert _rel(out, ref) < _tol(dtype)
    if DEV == "cuda" or dtype != torch.bfloat16:
        gate, up = x.chunk(2, dim=-1)
        eager = torch.nn.functional.silu(gate) * up  # what SiluAndMul runs off CUDA
        assert torch.allclose(out.float(), eager.float(), rtol=1e-6, atol=0)
    if DEV == "cuda":
        assert torch.equal(SiluAndMul()(x), out)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_cpu_packed_bf16_linear_gives_the_same_bits(rows: int) -> None:
    """CPU bf16 layers use oneDNN's packed weight layout; it must be F.linear to the bit."""
    from turnout.layers.linear import ColumnParallelLinear, pack_linears_for_cpu

    g = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(576, 960, bias=True)
    layer.weight.data = torch.randn(960, 576, generator=g).bfloat16()
    layer.bias.data = torch.randn(960, generator=g).bfloat16()
    if pack_linears_for_cpu(layer) == 0:
        pytest.skip("no oneDNN bf16 matmul on this CPU")
    x = torch.randn(rows, 576, generator=g).bfloat16()
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def _gemv_case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
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
    x, w, b, ref = _gemv_case(m, n, k, dtype, bias, seed=m * n + k)
    y = gemv.gemv(x, w, b, tile=(4, 64, 4))  # BLOCK_K below K: the K loop runs several times
    assert y.shape == (m, n) and y.dtype == dtype
    eps = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ((y.double() - ref).abs() <= 2 * eps * ref.abs() + 1e-2).all()  # one rounding + the interpreter's
    if DEV == "cuda":
        assert ((y.double() - F.linear(x, w, b).double()).abs() <= 2 * eps * ref.abs() + 1e-3).all()


def test_linear_routes_small_cuda_batches_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, _, _ = _gemv_case(2, 16, 32, torch.bfloat16, False)
    monkeypatch.delenv("TURNOUT_TRITON_GEMV", raising=False)
    gemv.switched_on.cache_clear()
    assert not gemv.enabled(x, w)  # off by default: not yet timed on a GPU
    monkeypatch.setenv("TURNOUT_TRITON_GEMV", "1")
    gemv.switched_on.cache_clear()
    assert gemv.enabled(x, w) == x.is_cuda
    assert not gemv.enabled(torch.cat([x] * 5), w)  # 10 rows > MAX_M
    assert not gemv.enabled(x.float(), w.float())
    if DEV == "cuda":
        assert torch.equal(linear(x, w, None, None), gemv.gemv(x, w))
    monkeypatch.delenv("TURNOUT_TRITON_GEMV")
    gemv.switched_on.cache_clear()
