"""The Triton kernels of layers/fused.py and layers/gemv.py against a float64 reference and against the torch
path they replace on CUDA. Off CUDA they run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnout.layers import fused, gemv
from turnout.layers.activation import GeluAndMul, SiluAndMul
from turnout.layers.linear import linear
from turnout.layers.norm import GemmaRMSNorm, RMSNorm
from turnout.layers.rotary import RotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _interpreter(triton_kernels) -> None:
    triton_kernels(fused.kernels)


def _tol(dtype: torch.dtype) -> float:
    # the interpreter has no bfloat16: it truncates where CUDA rounds to nearest, so its error is biased
    bf16 = 1e-2 if DEV == "cuda" else 2e-2
    return {torch.float32: 1e-5, torch.bfloat16: bf16, torch.float16: 2e-3}[dtype]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    x = x.double()
    return (unit_offset + w.double()) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


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
def test_gemma_rms_norm_applies_one_plus_w(dtype: torch.dtype) -> None:
    """GemmaRMSNorm's fused kernel: x / rms * (1 + w), rounded once; 2-D with a residual and 3-D per head."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96, generator=g).to(DEV, dtype)
    res = torch.randn(7, 96, generator=g).to(DEV, dtype)
    norm = GemmaRMSNorm(96, 1e-6).to(DEV)
    norm.weight.data = (0.3 * torch.randn(96, generator=g)).to(DEV, dtype)  # the checkpoint's w, about 0
    out, new_res = fused.rms_norm(x, norm.weight, norm.eps, res, unit_offset=True)
    if DEV == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(new_res, x + res)
    assert _rel(out, _ref_norm(x.double() + res.double(), norm.weight, norm.eps, True)) < _tol(dtype)
    heads = x.view(7, 3, 32)
    assert _rel(fused.rms_norm(heads, norm.weight[:32], 1e-6, unit_offset=True),
                _ref_norm(heads, norm.weight[:32], 1e-6, True)) < _tol(dtype)  # fmt: skip
    if DEV == "cuda":  # the layer takes the kernel on CUDA; its torch path is what the CPU runs
        assert torch.equal(norm(x, res)[0], out)
        eager = norm._norm(x + res)
        assert (out.float() - eager.float()).abs().max() <= 2 * eager.float().abs().max() * _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_and_mul(dtype: torch.dtype, approximate: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(6, 2 * 1500, generator=g)).to(DEV, dtype)  # |x| past tanh's saturation too
    out = fused.gelu_and_mul(x, approximate)
    ref = F.gelu(x[:, :1500].double(), approximate=approximate) * x[:, 1500:].double()
    assert _rel(out, ref) < _tol(dtype)
    if DEV == "cuda" or dtype != torch.bfloat16:
        gate, up = x.chunk(2, dim=-1)
        eager = F.gelu(gate, approximate=approximate) * up  # what GeluAndMul runs off CUDA
        # an ulp of the result, and where 1 + tanh or 1 + erf cancels, an ulp of 1 in gelu's 0.5 x (1 + ...)
        ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
        bound = 2 * ulp * (eager.float().abs() + (gate.float() * up.float()).abs())
        assert ((out.float() - eager.float()).abs() <= bound).all()
    if DEV == "cuda":
        assert torch.equal(GeluAndMul(approximate)(x), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qk_norm", ["qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("head", [64, 48])
def test_qk_norm_rope_from_packed_qkv(dtype: torch.dtype, qk_norm: str, head: int) -> None:
    t, hq, hkv = 5, 4, 2
    offset, qk_norm = qk_norm == "gemma3", qk_norm != "llama"
    g = torch.Generator().manual_seed(head + qk_norm)
    qkv_wide = torch.randn(t, (hq + 2 * hkv) * head + 8, generator=g).to(DEV, dtype)
    qkv = qkv_wide[:, 8:]  # strided rows, as a slice of a wider GEMM output would be
    pos = torch.tensor([0, 3, 17, 200, 511], device=DEV)
    rot = RotaryEmbedding(head, 512, 10000.0, None).to(DEV)
    qn, kn = RMSNorm(head, 1e-6).to(DEV), RMSNorm(head, 1e-6).to(DEV)
    qn.weight.data = (1 + 0.3 * torch.randn(head, generator=g)).to(DEV, dtype)
    kn.weight.data = (1 + 0.3 * torch.randn(head, generator=g)).to(DEV, dtype)
    w = (qn.weight, kn.weight) if qk_norm else (None, None)
    q, k = fused.qk_norm_rope(qkv, pos, hq, hkv, rot.cos, rot.sin, *w, 1e-6, unit_offset=offset)
    assert q.shape == (t, hq, head) and k.shape == (t, hkv, head) and q.is_contiguous()

    q_in = qkv[:, : hq * head].reshape(t, hq, head)
    k_in = qkv[:, hq * head : (hq + hkv) * head].reshape(t, hkv, head)
    q_ref, k_ref = q_in.double(), k_in.double()
    if qk_norm:
        q_ref, k_ref = _ref_norm(q_in, qn.weight, 1e-6, offset), _ref_norm(k_in, kn.weight, 1e-6, offset)
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
    if DEV == "cuda":  # cuBLAS rounds x w^T before it adds the bias: allow an ulp of each
        scale = ref.abs() + (b.double().abs() if b is not None else 0)
        assert ((y.double() - F.linear(x, w, b).double()).abs() <= 2 * eps * scale + 1e-3).all()


def test_linear_routes_small_cuda_batches_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, _, _ = _gemv_case(2, 16, 32, torch.bfloat16, False)
    monkeypatch.delenv("TURNOUT_TRITON_GEMV", raising=False)
    gemv.switched_on.cache_clear()
    assert gemv.enabled(x, w) == x.is_cuda  # on by default, CUDA only
    assert not gemv.enabled(torch.cat([x] * 2), w)  # 4 rows > MAX_M: cuBLAS is faster there
    assert not gemv.enabled(x.float(), w.float())
    if DEV == "cuda":
        assert torch.equal(linear(x, w, None, None), gemv.gemv(x, w))
    assert gemv.fits(x, w)
    monkeypatch.setenv("TURNOUT_GEMV_MAX_K", "16")
    gemv.max_k.cache_clear()
    assert not gemv.fits(x, w) and not gemv.enabled(x, w)  # a 32-feature row is past TURNOUT_GEMV_MAX_K
    monkeypatch.delenv("TURNOUT_GEMV_MAX_K")
    gemv.max_k.cache_clear()
    monkeypatch.setenv("TURNOUT_TRITON_GEMV", "0")
    gemv.switched_on.cache_clear()
    assert not gemv.enabled(x, w)
    monkeypatch.delenv("TURNOUT_TRITON_GEMV")
    gemv.switched_on.cache_clear()


def test_gemv_tiles_env_names_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """TURNOUT_GEMV_TILES replaces tiles()'s (BLOCK_N, num_warps) for the shapes it names, and a value that
    does not parse is one ConfigError that names the variable."""
    from turnout.errors import ConfigError

    default, unnamed = gemv.tiles(1, 4096, 1024, norm=True), gemv.tiles(1, 1024, 2048)
    monkeypatch.setenv("TURNOUT_GEMV_TILES", "4096x1024=8,2; 1024x3072=1,8")
    gemv.tile_overrides.cache_clear()
    try:
        assert gemv.tiles(1, 4096, 1024, norm=True) == (8, default[1], 2) != default
        assert gemv.tiles(1, 1024, 3072, silu_mul=True)[::2] == (1, 8)
        assert gemv.tiles(1, 1024, 2048) == unnamed  # not named: unchanged
        for bad in ("4096x1024=8", "4096x1024=6,4"):
            monkeypatch.setenv("TURNOUT_GEMV_TILES", bad)
            gemv.tile_overrides.cache_clear()
            with pytest.raises(ConfigError, match="TURNOUT_GEMV_TILES"):
                gemv.tiles(1, 4096, 1024)
    finally:
        gemv.tile_overrides.cache_clear()


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, n: int) -> bool:
    """a within n units in the last place of b's largest magnitude (both the same half-precision dtype)."""
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[b.dtype]
    return bool(((a.float() - b.float()).abs() <= n * ulp * b.float().abs().max()).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_norm_prologue(dtype: torch.dtype, m: int, with_residual: bool) -> None:
    """y = RMSNorm(x + residual) @ w^T in one kernel: against float64 and the two kernels it replaces."""
    k, n, eps = 96, 37, 1e-6  # K below its 128-wide tile: the masks
    g = torch.Generator().manual_seed(m + 2 * with_residual)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    res = torch.randn(m, k, generator=g).to(DEV, dtype) if with_residual else None
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    y, new_res = gemv.gemv(x, w, norm=(nw, eps), residual=res)
    h = x.double() + res.double() if res is not None else x.double()
    assert _rel(y, _ref_norm(h, nw, eps) @ w.double().T) < _tol(dtype)
    if res is None:
        assert new_res is x  # the first layer's residual is its input
    elif DEV == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(new_res, x + res)
    if DEV == "cuda" or dtype != torch.bfloat16:  # the interpreter's bf16 truncates
        xn = fused.rms_norm(x, nw, eps, res)[0] if res is not None else fused.rms_norm(x, nw, eps)
        assert _ulps_apart(y, gemv.gemv(xn, w), 2)  # the norm's float32 sum may run in another order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tile", [None, (2, 64, 4)], ids=["whole-row", "k-loop"])
def test_gemv_silu_mul_prologue(dtype: torch.dtype, tile: tuple[int, int, int] | None) -> None:
    """down_proj(silu(gate) * up) in one kernel, K = 1500: the default tile holds the whole row, (2, 64, 4)
    walks it in 24 tiles."""
    k, n = 1500, 24
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(2, 2 * k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    y = gemv.gemv(gate_up, w, tile=tile, silu_mul=True)
    act = F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    assert _rel(y, act @ w.double().T) < _tol(dtype)
    if DEV == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(y, gemv.gemv(fused.silu_and_mul(gate_up), w, tile=tile))  # the same rounding


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every kernel a layer launches from now on, as (kernel, rows, out features, options), in order."""
    calls: list[tuple] = []

    def spy(module, name, describe):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(describe(*args, **kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    def gemv_call(x, w, bias=None, tile=None, *, norm=None, residual=None, residual_out=None, silu_mul=False):
        opts = ("norm" if norm else "") + ("+residual" if residual is not None else "") + ("silu" * silu_mul)
        return ("gemv", x.shape[0], w.shape[0], opts)

    spy(gemv, "gemv", gemv_call)
    spy(F, "linear", lambda x, w, b=None: ("linear", x.shape[0], w.shape[0], ""))
    spy(fused, "rms_norm", lambda x, w, eps, r=None, ro=None: ("rms_norm", x.shape[0], x.shape[-1], ""))
    qk = lambda qkv, pos, hq, hkv, *a, **k: ("qk_norm_rope", qkv.shape[0], hq + hkv, "")  # noqa: E731
    spy(fused, "qk_norm_rope", qk)
    spy(fused, "silu_and_mul", lambda x: ("silu_and_mul", x.shape[0], x.shape[1] // 2, ""))
    return calls


def test_decoder_layer_picks_kernels_in_its_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 decoder layer at decode size, with the GEMV routing on and off. Its layers pick the kernels:
    on, both RMSNorms run in the prologue of the GEMV after them and SiLU-and-mul in down_proj's (four GEMVs
    and the fused q/k norm + rotary); off, a kernel per op. Both give the same result to a few ulps. Each
    token is a one-token sequence: its attention output is its v."""
    from turnout.layers.attention import ForwardContext, forward_context
    from turnout.models.decoder import DecoderLayer

    dtype = torch.float16  # the interpreter's bf16 truncates; CUDA checks fp16 the same way
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 160, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}  # fmt: skip
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, qkv_bias=False, qk_norm=True).to(DEV, dtype)
    for p in layer.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) / p.shape[-1] ** 0.5 + (p.dim() == 1)).to(dtype)
    monkeypatch.setattr(fused, "enabled", lambda x: True)  # the fused kernels on CPU too (interpreter)
    if DEV == "cpu":  # route as on CUDA, for CPU tensors (the kernels run in the interpreter)

        def enabled_as_on_cuda(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
            half = x.dtype in (torch.float16, torch.bfloat16) and (w is None or w.dtype == x.dtype)
            return x.dim() == 2 and x.shape[0] <= gemv.MAX_M and half and gemv.switched_on()

        monkeypatch.setattr(gemv, "enabled", enabled_as_on_cuda)
    calls = _record_launches(monkeypatch)

    def one_token_attention(layer_idx, q, k, v):  # [T, H, D] -> [T, H D]: softmax over one key is 1
        calls.append(("attention", q.shape[0], q.shape[1], ""))
        return v.repeat_interleave(q.shape[1] // k.shape[1], dim=1).reshape(q.shape[0], -1)

    ctx = ForwardContext(impls=[], meta=None, kv_caches=[], hole=one_token_attention)  # type: ignore[arg-type]
    pos = torch.tensor([5, 9], device=DEV)
    x = torch.randn(2, 64, device=DEV, dtype=dtype)
    qkv_n, inter = (4 + 2 * 2) * 32, 160
    g, a = "gemv", "attention"
    gemv_path = [(g, 2, qkv_n, "norm+residual"), ("qk_norm_rope", 2, 6, ""), (a, 2, 4, ""),
                 (g, 2, 64, ""), (g, 2, 2 * inter, "norm+residual"), (g, 2, 64, "silu")]  # fmt: skip
    lin = "linear"
    per_op = [("rms_norm", 2, 64, ""), (lin, 2, qkv_n, ""), ("qk_norm_rope", 2, 6, ""), (a, 2, 4, ""),
              (lin, 2, 64, ""), ("rms_norm", 2, 64, ""), (lin, 2, 2 * inter, ""),
              ("silu_and_mul", 2, inter, ""), (lin, 2, 64, "")]  # fmt: skip
    with forward_context(ctx):
        for residual in (None, torch.randn(2, 64, device=DEV, dtype=dtype)):
            first = [(c[0], c[1], c[2], c[3].replace("norm+residual", "norm")) for c in gemv_path[:1]]
            calls.clear()
            out, res = layer(pos, x, residual)
            assert calls == (gemv_path if residual is not None else first + gemv_path[1:])
            monkeypatch.setenv("TURNOUT_TRITON_GEMV", "0")  # every matmul to F.linear (cuBLAS)
            gemv.switched_on.cache_clear()
            calls.clear()
            ref_out, ref_res = layer(pos, x, residual)
            assert calls == per_op
            monkeypatch.delenv("TURNOUT_TRITON_GEMV")
            gemv.switched_on.cache_clear()
            assert torch.equal(res, ref_res)
            assert _ulps_apart(out, ref_out, 4)  # two norms' sums in another order, then two matmuls
            assert not torch.equal(out, torch.zeros_like(out))
    gemv.switched_on.cache_clear()
