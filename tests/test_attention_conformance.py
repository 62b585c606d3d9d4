"""One conformance suite for every installed attention backend (entry-point group `turnout`).

Each case draws a random paged step (attention_reference.make_case), poisons every cache slot that
holds no token with NaN, has the backend make a metadata builder and the layer's impl for the step's
AttentionSpec, runs build + forward,
and checks:
  - the output against a float64 reference by ||out - ref|| / ||ref||, and that it is finite;
  - the cache bit for bit: k, v written exactly at slot_mapping, every other slot (poison included)
    untouched;
  - that q, k, v were not modified.
The scale cases give a softmax scale other than head_size ** -0.5, so a backend must use spec.scale; the
per-layer cases run a layer with its own scale, sliding window or logit soft-cap (AttentionLayerSpec), for
the backends that declare those attention_features, so a backend must use the layer it is given. The FP8
cases run a float8_e4m3fn cache (kv_cache_dtype fp8) with per-layer scales for the backends that declare
"fp8" in kv_cache_dtypes: the cache bit for bit against vLLM's quantization formula, and the output
against the reference on the dequantized cache.
Off CUDA, Triton backends run under TRITON_INTERPRET=1, which is set only while the backends are
discovered (and their libraries imported) and while this module's tests run (triton imports more of
itself lazily), so the other test modules do not see it.
TURNOUT_PLUGINS=name[,name] limits the suite to those entry points, as it limits the engine.
The CPU run uses small shapes; the `gpu` cases run the full product with larger ones.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import itertools
import os
import random

import pytest
import torch

from turnout.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    AttentionSpec,
    CudagraphSupport,
)
from turnout.platform import current_platform

from attention_reference import KINDS, make_case, ref_paged_attention

PLATFORM = current_platform()
ON_CUDA = PLATFORM.is_cuda
DEVICE = "cuda" if ON_CUDA else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# Over an FP8 cache the reference reads the dequantized cache, so only the backend's own rounding counts.
# bfloat16 gets twice TOL: Triton's interpreter casts float32 to bfloat16 by truncation (32,499 of 65,536
# randn values differ from round-to-nearest), and its K/V tiles are dequantized in float32 and cast to
# bfloat16 (measured with the interpreter: up to 9.6e-3, CPU backend 3.0e-3; float16 3.0e-4, float32 2.7e-7)
TOL_FP8 = {**TOL, torch.bfloat16: 2e-2}
BATCHES = {  # name -> (request kinds drawn from, graph-padding tokens, decode rows first)
    "decode": (("decode",), 0, True),
    "prefill": (("prefill",), 0, True),
    "prefix": (("prefix",), 0, True),
    "chunked": (("chunked",), 0, True),
    "mixed": (KINDS, 0, True),
    "padded": (KINDS, 5, True),  # CUDA-graph padding: trailing tokens with slot -1
    "unordered": (KINDS, 0, False),  # decode rows anywhere; num_decode_tokens counts the leading ones
}
GQAS = (1, 2, 4, 8)
HEADS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMALL = dict(num_reqs=4, num_kv_heads=2, max_ctx=64, max_query=24)  # the interpreter is slow
LARGE = dict(num_reqs=8, num_kv_heads=4, max_ctx=1500, max_query=200)


def _discover() -> list[tuple[str, AttentionBackend | None, str]]:
    """(entry point, backend, why it failed to load) for every backend the installed plugins offer."""
    allow = os.environ.get("TURNOUT_PLUGINS")
    allow = None if allow is None else {n.strip() for n in allow.split(",")}
    prev = os.environ.get("TRITON_INTERPRET")
    if not ON_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    found = []
    try:
        for ep in sorted(md.entry_points(group="turnout"), key=lambda e: e.name):
            if allow is not None and ep.name not in allow:
                continue
            try:
                hook = getattr(ep.load(), "turnout_attention_backends", None)
                backends = hook(platform=PLATFORM) if hook else []
            except Exception as e:  # a broken plugin is reported, not fatal to the others
                found.append((ep.name, None, f"{type(e).__name__}: {e}".splitlines()[0]))
                continue
            for be in backends:
                be.import_error()  # heavy imports happen here, under the interpreter flag
                found.append((ep.name, be, ""))
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev
    return found


def _backend_params() -> list:
    params = []
    for ep, be, err in _discover():
        if be is None:
            params.append(pytest.param(None, id=ep, marks=pytest.mark.skip(reason=f"plugin {ep}: {err}")))
        else:
            params.append(pytest.param(be, id=be.name))
    return params or [pytest.param(None, marks=pytest.mark.skip(reason="no attention backend installed"))]


BACKENDS = _backend_params()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _block_size(be: AttentionBackend, want: int = 16) -> int:
    m = be.block_size_multiple
    return want if want % m == 0 else m * -(-want // m)


def _layers(
    scale: float, layer: AttentionLayerSpec | None, fp8: tuple[float, float] | None = None
) -> tuple[AttentionLayerSpec, ...]:
    """The spec's layers: one plain layer at scale (with fp8's k_scale, v_scale), or that one and `layer`
    (index 1) after it."""
    k_scale, v_scale = fp8 or (1.0, 1.0)
    return (AttentionLayerSpec(0, scale, k_scale=k_scale, v_scale=v_scale),) + ((layer,) if layer else ())


def _run(be: AttentionBackend, batch: str, gqa: int, head: int, dtype: torch.dtype, seed: int, shape: dict,
         block_size: int | None = None, scale: float | None = None, layer: AttentionLayerSpec | None = None,
         fp8: tuple[float, float] | None = None) -> float:  # fmt: skip
    """One random step through be; with `layer`, as the second of two layers, the first plain at the
    spec's scale, the second with layer's scale and features; with fp8 (k_scale, v_scale), over an FP8
    cache. Returns the relative error."""
    bs = block_size or _block_size(be)
    layers = _layers(scale or head**-0.5, layer, fp8)
    features = AttentionSpec(1, 1, head, dtype, bs, layers[0].scale, len(layers), layers).features
    kv_heads = shape["num_kv_heads"]
    kv_dtype = "auto" if fp8 is None else "fp8"
    ctx = AttentionContext(PLATFORM, dtype, head, kv_heads * gqa, kv_heads, bs, features, kv_dtype)
    if reasons := be.check(ctx):
        pytest.skip(f"{be.name}: " + "; ".join(reasons))
    kinds, pad, decode_first = BATCHES[batch]
    rng = random.Random(f"{seed}-{batch}-{gqa}-{head}-{dtype}-{bs}")
    c = make_case(rng, gqa=gqa, head_size=head, dtype=dtype, block_size=bs, kinds=kinds, pad_tokens=pad,
                  decode_first=decode_first, device=DEVICE, fp8_scales=fp8, **shape)  # fmt: skip
    run = layers[-1]
    if scale is not None or layer is not None:  # the same step under the layer's scale and features
        features = dict(sliding_window=run.sliding_window, logits_soft_cap=run.logits_soft_cap)
        expected = ref_paged_attention(c.q, c.expected_cache, c.meta, run.scale, c.num_kv_heads, **features)
        c = dataclasses.replace(c, scale=layers[0].scale, expected=expected)
    heads = (c.q.shape[1], c.num_kv_heads, head)
    spec = AttentionSpec(*heads, dtype, bs, c.scale, len(layers), layers, kv_dtype)
    inputs = [x.clone() for x in (c.q, c.k, c.v)]
    c.meta.backend_data = be.make_builder(spec, 0).build(c.meta)
    out = be.make_impl(spec, run).forward(c.q, c.k, c.v, c.kv_cache, c.meta)
    n, m = c.meta.num_actual_tokens, c.meta
    where = f"{be.name} {batch}: {c.kinds}, seq_lens={m.seq_lens.tolist()} cu={m.query_start_loc.tolist()}"
    where += f", scale {c.scale:.4g}" if scale is not None else ""
    where += f", layer {run}" if layer is not None else ""
    where += f", FP8 cache, scales {fp8}" if fp8 is not None else ""
    assert out.shape == c.q.shape and out.dtype == dtype, where
    assert torch.isfinite(out[:n]).all(), f"non-finite output: {where}"
    err = ((out[:n].double() - c.expected).norm() / c.expected.norm()).item()
    if log := os.environ.get("TURNOUT_CONFORMANCE_ERRORS"):  # for the recorded H200 summary
        with open(log, "a") as f:
            f.write(f"{be.name}\t{str(dtype)[6:]}\t{head}\t{gqa}\t{batch}\t{err:.3e}\n")
    tol = (TOL if fp8 is None else TOL_FP8)[dtype]
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}: {where}"
    changed = (c.kv_cache.view(torch.uint8) != c.expected_cache.view(torch.uint8)).nonzero()
    assert changed.numel() == 0, f"cache differs from a write at slot_mapping at bytes {changed[:4].tolist()}"
    assert all(torch.equal(a, b) for a, b in zip(inputs, (c.q, c.k, c.v))), f"q, k or v modified: {where}"
    return err


def _covering() -> list:
    """Every batch kind x GQA ratio; head size and dtype rotate so that every pair of values meets."""
    params = []
    for (i, batch), (j, gqa) in itertools.product(enumerate(BATCHES), enumerate(GQAS)):
        head, dtype = HEADS[(i + j) % 2], DTYPES[(i + j) % 3]
        params.append(pytest.param(batch, gqa, head, dtype, id=f"{batch}-gqa{gqa}-d{head}-{str(dtype)[6:]}"))
    return params


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("batch,gqa,head,dtype", _covering())
def test_conformance(be: AttentionBackend, batch: str, gqa: int, head: int, dtype: torch.dtype) -> None:
    _run(be, batch, gqa, head, dtype, seed=0, shape=LARGE if ON_CUDA else SMALL)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 8, 48])
def test_block_sizes(be: AttentionBackend, block_size: int) -> None:
    _run(be, "mixed", 2, 64, torch.float16, seed=1, shape=LARGE if ON_CUDA else SMALL, block_size=block_size)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("head", [80, 96, 256])
def test_head_sizes(be: AttentionBackend, head: int) -> None:
    _run(be, "mixed", 4, head, torch.float16, seed=5, shape=LARGE if ON_CUDA else SMALL)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize(
    "batch,dtype,scale",
    [("decode", torch.float16, 0.05), ("mixed", torch.float32, 1.0), ("mixed", torch.bfloat16, 0.3)],
    ids=["decode-float16-0.05", "mixed-float32-1.0", "mixed-bfloat16-0.3"],
)
def test_softmax_scale(be: AttentionBackend, batch: str, dtype: torch.dtype, scale: float) -> None:
    """Scales far from head_size ** -0.5 (0.125 here), as Gemma's query_pre_attn_scalar or a model's
    per-layer scale give: a backend that ignores spec.scale fails them."""
    _run(be, batch, 2, 64, dtype, seed=6, shape=LARGE if ON_CUDA else SMALL, scale=scale)


FEATURES = {  # id -> the run layer's (sliding_window, logits_soft_cap): windows below, across and above a
    # key tile (the interpreter's are 32 keys) and a block, and caps that change most scores (std ~1 here)
    "window7": (7, None),
    "window40": (40, None),
    "softcap2": (None, 2.0),
    "window19-softcap5": (19, 5.0),
}


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize(
    "batch,dtype",
    [
        ("decode", torch.float32),
        ("chunked", torch.bfloat16),
        ("mixed", torch.float32),
        ("unordered", torch.float16),
    ],
    ids=["decode-float32", "chunked-bfloat16", "mixed-float32", "unordered-float16"],
)
@pytest.mark.parametrize("features", list(FEATURES))
def test_layer_features(be: AttentionBackend, batch: str, dtype: torch.dtype, features: str) -> None:
    """A layer with a sliding window, a logit soft-cap or both, at a scale of its own, against the float64
    reference; backends that do not declare the feature (selection refuses them such models) skip."""
    window, cap = FEATURES[features]
    layer = AttentionLayerSpec(1, 0.1, sliding_window=window, logits_soft_cap=cap)
    _run(be, batch, 2, 64, dtype, seed=7, shape=LARGE if ON_CUDA else SMALL, layer=layer)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_per_layer_scale(be: AttentionBackend, batch: str) -> None:
    """Layer 1's own scale (0.3) differs from the spec's (layer 0's, 0.125): a backend that attends with
    spec.scale instead of the layer's fails."""
    _run(be, batch, 2, 64, torch.float32, seed=8, shape=LARGE if ON_CUDA else SMALL,
         layer=AttentionLayerSpec(1, 0.3))  # fmt: skip


FP8_CASES = [  # (batch, dtype, gqa, head, (k_scale, v_scale)): every phase, each dtype, vLLM's default
    # scale 1.0 and scales that put the inputs (std 1) near e4m3's top (448 * 0.01 = 4.5 sigma)
    ("decode", torch.bfloat16, 4, 64, (1.0, 1.0)),
    ("decode", torch.float32, 2, 128, (0.01, 0.02)),
    ("prefill", torch.float16, 2, 64, (0.01, 0.02)),
    ("prefix", torch.bfloat16, 1, 128, (0.02, 0.5)),
    ("chunked", torch.bfloat16, 4, 64, (0.01, 0.02)),
    ("mixed", torch.float16, 8, 64, (1.0, 1.0)),
    ("padded", torch.bfloat16, 2, 64, (0.01, 0.02)),
    ("unordered", torch.float32, 4, 64, (0.02, 0.01)),
]


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize(
    "batch,dtype,gqa,head,scales", FP8_CASES, ids=[f"{b}-{str(d)[6:]}-{s[0]}" for b, d, _, _, s in FP8_CASES]
)
def test_fp8_kv_cache(
    be: AttentionBackend, batch: str, gqa: int, head: int, dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    """kv_cache_dtype fp8: the cache holds e4m3(clamp(x / scale)) bit for bit, poison untouched, and the
    output matches the float64 reference on the dequantized cache within the activations' dtype's tolerance
    (the backend's own rounding; e4m3's is in the reference). Backends without "fp8" skip: selection refuses
    them an FP8 cache."""
    _run(be, batch, gqa, head, dtype, seed=11, shape=LARGE if ON_CUDA else SMALL, fp8=scales)


MLA_CASES = [  # (batch, dtype, query heads over the one latent head, kv_lora_rank, rope dims): every phase,
    # widths that are powers of two and widths that are not (48 + 8), and DeepSeek-V2-Lite's 512 + 64 x 16
    ("decode", torch.float32, 4, 64, 16),
    ("prefill", torch.bfloat16, 2, 48, 8),
    ("prefix", torch.float16, 4, 64, 16),
    ("chunked", torch.float32, 8, 48, 8),
    ("mixed", torch.bfloat16, 16, 512, 64),
    ("padded", torch.float32, 4, 64, 16),
    ("unordered", torch.float16, 2, 48, 8),
]


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize(
    "batch,dtype,heads,rank,rope", MLA_CASES, ids=[f"{b}-{str(d)[6:]}-{r}+{e}" for b, d, _, r, e in MLA_CASES]
)
def test_mla_latent_cache(be: AttentionBackend, batch: str, dtype: torch.dtype, heads: int, rank: int,
                          rope: int) -> None:  # fmt: skip
    """Multi-head latent attention ("mla" spec, spec.kv_lora_rank): one KV head of rank + rope dims whose
    first rank dims are the values. The cache [num_blocks, block_size, 1, rank + rope] gets k alone, bit for
    bit, poison untouched; the output [T, H, rank] matches the float64 reference over keys and values read
    from that one cache. Backends that do not serve "mla" skip."""
    head, bs = rank + rope, _block_size(be)
    if reasons := be.check(AttentionContext(PLATFORM, dtype, head, heads, 1, bs, kv_lora_rank=rank)):
        pytest.skip(f"{be.name}: " + "; ".join(reasons))
    kinds, pad, decode_first = BATCHES[batch]
    rng = random.Random(f"mla-{batch}-{heads}-{head}-{dtype}")
    shape = {**(LARGE if ON_CUDA else SMALL), "num_kv_heads": 1}
    c = make_case(rng, gqa=heads, head_size=head, dtype=dtype, block_size=bs, kinds=kinds, pad_tokens=pad,
                  decode_first=decode_first, device=DEVICE, **shape)  # fmt: skip
    cache, expected_cache = c.kv_cache[0].clone(), c.expected_cache[0]  # the keys' pages only
    expected = ref_paged_attention(c.q, torch.stack([expected_cache] * 2), c.meta, c.scale, 1)[..., :rank]
    spec = AttentionSpec(heads, 1, head, dtype, bs, c.scale, 1, kv_lora_rank=rank)
    assert be.kv_cache_shape(cache.shape[0], bs, 1, head, rank) == tuple(cache.shape)
    inputs = [x.clone() for x in (c.q, c.k)]
    c.meta.backend_data = be.make_builder(spec, 0).build(c.meta)
    out = be.make_impl(spec, spec.layer(0)).forward(c.q, c.k, c.k[..., :rank], cache, c.meta)
    n, m = c.meta.num_actual_tokens, c.meta
    where = f"{be.name} {batch}: {c.kinds}, seq_lens={m.seq_lens.tolist()} cu={m.query_start_loc.tolist()}"
    assert out.shape == (c.q.shape[0], heads, rank) and out.dtype == dtype, where
    assert torch.isfinite(out[:n]).all(), f"non-finite output: {where}"
    err = ((out[:n].double() - expected).norm() / expected.norm()).item()
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}: {where}"
    changed = (cache.view(torch.uint8) != expected_cache.view(torch.uint8)).nonzero()
    assert changed.numel() == 0, f"cache differs from a write at slot_mapping at bytes {changed[:4].tolist()}"
    assert all(torch.equal(a, b) for a, b in zip(inputs, (c.q, c.k))), f"q or k modified: {where}"


@pytest.mark.slow
@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("batch", ["decode", "chunked", "mixed"])
def test_long_context(be: AttentionBackend, batch: str) -> None:
    """Contexts long enough for split-KV decode and many key tiles, still small for the interpreter."""
    shape = dict(num_reqs=3, num_kv_heads=1, max_ctx=900, max_query=96)
    _run(be, batch, 4, 128, torch.bfloat16, seed=2, shape=LARGE if ON_CUDA else shape)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("gqa", GQAS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_conformance_full(be: AttentionBackend, batch: str, gqa: int, head: int, dtype: torch.dtype) -> None:
    _run(be, batch, gqa, head, dtype, seed=3, shape=LARGE)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("be", BACKENDS)
def test_cudagraph_replay(be: AttentionBackend) -> None:
    """Capture forward once on static metadata buffers holding a dummy batch, then replay it on a real
    batch of the same shapes copied into those buffers: what the support level promises."""
    if be.cudagraph_support == CudagraphSupport.NEVER:
        pytest.skip(f"{be.name} does not support CUDA graphs")
    batch = "padded" if be.cudagraph_support == CudagraphSupport.ALWAYS else "decode"
    bs = _block_size(be)
    ctx = AttentionContext(PLATFORM, torch.bfloat16, 128, 16, 4, bs)
    if reasons := be.check(ctx):
        pytest.skip("; ".join(reasons))
    kinds, pad, _ = BATCHES[batch]
    c = make_case(random.Random(4), gqa=4, head_size=128, dtype=torch.bfloat16, block_size=bs, kinds=kinds,
                  pad_tokens=pad, device=DEVICE, **LARGE)  # fmt: skip
    m = c.meta
    spec = AttentionSpec(c.q.shape[1], c.num_kv_heads, 128, torch.bfloat16, bs, c.scale, num_layers=1)
    impl = be.make_impl(spec, spec.layer(0))
    real = {f: getattr(m, f).clone() for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_table")}
    b, t = m.num_reqs, c.q.shape[0]
    cu = torch.arange(b + 1, device=DEVICE) * (m.num_actual_tokens // b)  # dummy: equal queries, no context
    cu[-1] = m.num_actual_tokens
    m.query_start_loc.copy_(cu)
    m.seq_lens.copy_(cu[1:] - cu[:-1])
    m.block_table.zero_()
    m.slot_mapping.fill_(-1)
    host = (m.max_query_len, m.max_seq_len)
    m.max_query_len = int(m.seq_lens.max())  # max_seq_len stays the real one: an upper bound, as in capture
    m.backend_data = be.make_builder(spec, 0).build(m)
    cache0 = c.kv_cache.clone()
    impl.forward(c.q, c.k, c.v, c.kv_cache, m)  # warm-up: compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = impl.forward(c.q, c.k, c.v, c.kv_cache, m)
    for f, x in real.items():
        getattr(m, f).copy_(x)
    m.max_query_len, m.max_seq_len = host
    c.kv_cache.copy_(cache0)
    g.replay()
    torch.cuda.synchronize()
    n = m.num_actual_tokens
    err = ((out[:n].double() - c.expected).norm() / c.expected.norm()).item()
    assert err <= TOL[torch.bfloat16], f"{be.name} replay of {batch} ({t} tokens): relative error {err:.2e}"
    assert torch.equal(c.kv_cache.view(torch.uint8), c.expected_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.slow
def test_triton_decode_split_count_does_not_change_bits(dtype: torch.dtype) -> None:
    """CUDA graphs launch Triton's decode with MAX_SPLITS, eager steps with as few as cover max_seq_len, and
    either with 1 to all-splits programs per request: all must give the same bits, or graphs would change
    greedy outputs (issue #5)."""
    be = next(
        (p.values[0] for p in BACKENDS if p.values[0] is not None and p.values[0].name == "triton"), None
    )
    if be is None:
        pytest.skip("triton backend not installed")
    from turnout_triton import kernels as kn

    shape = dict(num_reqs=4, num_kv_heads=2, max_ctx=3 * kn.SPLIT_KEYS, max_query=16)
    kinds = ("decode", "prefix")
    c = make_case(random.Random(9), gqa=4, head_size=64, dtype=dtype, block_size=16, kinds=kinds,
                  device=DEVICE, **shape)  # fmt: skip
    m, n = c.meta, c.meta.num_actual_tokens
    kv = (m.query_start_loc, m.seq_lens, m.block_table)
    base = kn.num_splits(m.max_seq_len)
    outs = {}
    counts = kn.split_counts(m.num_reqs * c.num_kv_heads, c.q.device)  # one buffer for every launch
    for s in sorted({base, min(2 * base, kn.MAX_SPLITS), kn.MAX_SPLITS}):
        for p in sorted({1, 2, s}):
            cache = c.kv_cache.clone()
            out = kn.paged_attention(
                c.q, c.k, c.v, cache, m.slot_mapping, *kv, c.scale, m.max_query_len, s, counts, programs=p
            )
            outs[s, p] = out[:n]
            assert not counts.any(), f"{s} splits on {p} programs left split counters set"
    assert base < kn.MAX_SPLITS and int(m.seq_lens.max()) > kn.SPLIT_KEYS  # several splits really ran
    first = outs[base, base]
    err = ((first.double() - c.expected).norm() / c.expected.norm()).item()
    assert err <= TOL[dtype]
    for (s, p), out in outs.items():
        assert torch.equal(out, first), f"{s} splits on {p} programs differ from {base} on {base}"


def test_triton_fp8_store_rounds_as_torch() -> None:
    """The Triton store writes the bits torch's clamp-and-cast gives (round to nearest even, saturation
    at 448, e4m3 subnormals, the sign of zero), at two scales, from every activation dtype: the rounding
    the interpreter's own float32 -> e4m3 cast gets wrong on ties and mantissa carries."""
    be = next(
        (p.values[0] for p in BACKENDS if p.values[0] is not None and p.values[0].name == "triton"), None
    )
    if be is None:
        pytest.skip("triton backend not installed")
    from turnout_triton import kernels as kn

    from attention_reference import FP8, fp8_quantize

    gen = torch.Generator().manual_seed(12)
    edges = [
        0.0,
        -0.0,
        448.0,
        -448.0,
        464.0,
        -480.0,
        1e4,
        2.0**-10,
        3 * 2.0**-10,
        2.0**-9,
        2.0**-6,
        8.5,
        -31.0,
    ]
    for dtype in DTYPES:
        for scale in (1.0, 0.037):
            x = torch.cat(
                [torch.randn(4001, generator=gen) * m for m in (0.01, 1.0, 100.0)]
            )  # 12003 + 13 edges + 272 zeros: tokens of one 256-wide head, a program each in the interpreter
            x = torch.cat([x, torch.tensor(edges) * scale, torch.zeros(272)]).to(dtype).view(-1, 1, 256)
            cache = torch.zeros(2, x.shape[0], 1, 1, 256, dtype=FP8, device=DEVICE)
            slots = torch.arange(x.shape[0], device=DEVICE)
            kn.store_kv(x.to(DEVICE), x.to(DEVICE), cache, slots, scale, scale)
            want = fp8_quantize(x, scale).view(torch.uint8).to(DEVICE)
            bad = (cache[0].view(torch.uint8).view_as(want) != want).sum().item()
            assert bad == 0, (
                f"{bad} of {want.numel()} e4m3 values differ from torch's ({dtype}, scale {scale})"
            )
