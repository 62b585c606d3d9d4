"""The FlashInfer and FlashAttention plugins, CPU side: they load without their libraries, say precisely why
they cannot serve, and the torch helpers they use (paged indices, turnout.attention's KV write) are right.
Their kernels run in the GPU conformance suite (test_attention_conformance.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from turnout.attention import (
    LAYER_FEATURES,
    AttentionContext,
    AttentionMetadata,
    AttentionSpec,
    CudagraphSupport,
    store_kv,
)
from turnout.platform import Platform
from turnout.plugins import PluginManager

fi_backend = pytest.importorskip(
    "turnout_flashinfer.backend", reason="pip install --no-deps -e plugins/attention/flashinfer"
)
fa_backend = pytest.importorskip(
    "turnout_flash_attn.backend", reason="pip install --no-deps -e plugins/attention/flash_attn"
)

H200 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.float16, torch.bfloat16, torch.float32))
A100 = Platform("cuda", "A100", 1, (8, 0), 80 << 30, (torch.float16, torch.bfloat16, torch.float32))
CPU = Platform("cpu", "cpu", 1, None, 16 << 30, (torch.float32, torch.bfloat16, torch.float16))
NO_FLASHINFER = importlib.util.find_spec("flashinfer") is None
NO_FLASH_ATTN = importlib.util.find_spec("flash_attn") is None
FA_MISSING = fa_backend.NOT_INSTALLED


def ctx(platform=H200, dtype=torch.bfloat16, head=128, heads=32, kv_heads=8, block=16) -> AttentionContext:
    return AttentionContext(platform, dtype, head, heads, kv_heads, block)


@pytest.fixture
def flashinfer():
    return fi_backend.FlashInferBackend()


@pytest.fixture
def flash_attn(monkeypatch):
    monkeypatch.delenv("TURNOUT_FLASH_ATTN", raising=False)
    return fa_backend.FlashAttnBackend(H200)


def test_plugins_load_through_entry_points():
    pm = PluginManager()
    pm.load_entry_points()
    info = {i.name: i for i in pm.listing()}
    for name, dist in (("flashinfer", "turnout-flashinfer"), ("flash_attn", "turnout-flash-attn")):
        assert (info[name].status, info[name].distribution) == ("loaded", dist)
        assert info[name].hooks == ["turnout_attention_backends", "turnout_env_vars"]
    backends = {
        b.name: b for res in pm.call_each("turnout_attention_backends", platform=H200) for b in res.value
    }
    assert backends["flashinfer"].priority == 20 and backends["flash_attn"].priority == 10


def test_plugins_import_without_their_libraries():
    code = "import sys, turnout_flashinfer, turnout_flash_attn; print(*(m in sys.modules for m in %r))"
    code %= (("flashinfer", "flash_attn"),)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_cpu_platform_is_refused_without_importing(flashinfer):
    on_cpu = fa_backend.FlashAttnBackend(CPU)
    for be in (flashinfer, on_cpu):
        assert be.check(ctx(CPU)) == ["needs device cuda, have cpu"]
    assert on_cpu.probe == fa_backend.Probe(None, "needs a CUDA device")  # no library was looked for


@pytest.mark.skipif(not NO_FLASHINFER, reason="flashinfer is installed here")
def test_flashinfer_missing_library_on_h200(flashinfer):
    assert flashinfer.check(ctx()) == ["flashinfer is not installed (pip install flashinfer-python)"]


@pytest.mark.skipif(not NO_FLASH_ATTN, reason="flash_attn is installed here")
def test_flash_attn_missing_library_on_h200_and_a100(flash_attn):
    assert flash_attn.check(ctx()) == [FA_MISSING]
    assert flash_attn.check(ctx(A100)) == [FA_MISSING]
    assert flash_attn.cudagraph_support == CudagraphSupport.NEVER and flash_attn.block_size_multiple == 1


@pytest.mark.skipif(not NO_FLASH_ATTN, reason="flash_attn is installed here")
@pytest.mark.parametrize(
    "force,cap,why",
    [
        ("2", (9, 0), "flash_attn 2.x is not installed (pip install turnout-flash-attn[fa2])"),
        ("4", (9, 0), "flash-attn-4 is not installed (pip install flash-attn-4)"),
        ("4", (8, 0), "FA4 needs compute capability >= 9.0, have 8.0"),
        ("4", (12, 0), "FA4 has no paged KV on compute capability 12.0"),
    ],
)
def test_flash_attn_forced_path_reasons(monkeypatch, force, cap, why):
    monkeypatch.setenv("TURNOUT_FLASH_ATTN", force)
    platform = Platform("cuda", "gpu", 1, cap, 80 << 30, (torch.float16, torch.bfloat16))
    assert fa_backend.FlashAttnBackend(platform).check(ctx(platform)) == [why]


def test_dtype_head_and_gqa_reasons(flashinfer, flash_attn):
    # the library is imported only when nothing else is wrong: these reasons never mention it
    assert flashinfer.check(ctx(dtype=torch.float32, head=96)) == [
        "dtype float32 unsupported (supports float16, bfloat16)",
        "head size 96 unsupported (supports [64, 128, 256])",
    ]
    assert flash_attn.check(ctx(dtype=torch.float32, heads=12, kv_heads=8)) == [
        "dtype float32 unsupported (supports float16, bfloat16)",
        "num_heads 12 not divisible by num_kv_heads 8",
    ]
    old = Platform("cuda", "T4", 1, (7, 5), 16 << 30, (torch.float16, torch.float32))
    for be in (flashinfer, flash_attn):
        assert be.check(ctx(old, dtype=torch.float16))[0] == "needs compute capability >= 8.0, have (7, 5)"


def test_flashinfer_takes_any_block_size(flashinfer):
    for block in (1, 7, 16, 48, 256):
        reasons = flashinfer.check(ctx(block=block))
        assert not [r for r in reasons if "block" in r]
    assert flashinfer.cudagraph_support == CudagraphSupport.UNIFORM_DECODE  # static decode wrappers


def test_flash_attn_path_constraints():
    """The library found fixes the declared capabilities once, at construction; check() changes nothing."""
    fa2 = fa_backend.FlashAttnBackend(H200, fa_backend.Probe("fa2"))
    assert (fa2.block_size_multiple, fa2.cudagraph_support) == (256, CudagraphSupport.UNIFORM_BATCH)
    before = dict(vars(fa2))
    assert fa2.check(ctx(block=16, head=100)) == [
        "block_size 16 is not a multiple of 256",
        "FA2 needs head size a multiple of 8 up to 256, got 100",
    ]
    assert fa2.check(ctx(block=512, head=96)) == [] and vars(fa2) == before
    fa4 = fa_backend.FlashAttnBackend(H200, fa_backend.Probe("fa4"))
    assert (fa4.block_size_multiple, fa4.min_capability) == (1, (9, 0))
    assert fa4.cudagraph_support == CudagraphSupport.ALWAYS  # a FULL capture replays like eager
    for head in (64, 96, 128, 256):
        assert fa_backend.path_reasons("fa4", ctx(head=head, block=1)) == []
    assert fa_backend.path_reasons("fa4", ctx(head=72)) == [
        "FA4 paged KV needs head size a multiple of 16 up to 256, got 72"
    ]
    b200 = Platform("cuda", "B200", 1, (10, 0), 180 << 30, (torch.float16, torch.bfloat16))
    assert fa_backend.path_reasons("fa4", ctx(b200, head=192)) == [
        "FA4 paged KV needs head size a multiple of 16 up to 128 (or exactly 256), got 192"
    ]


def test_flash_attn_serves_layer_features_on_fa4_only():
    """FA4 takes each layer's scale, window and soft-cap; FA2 takes none, so a Gemma-like model is refused."""
    gemma = AttentionContext(H200, torch.bfloat16, 256, 16, 8, 128, frozenset(LAYER_FEATURES))
    fa4 = fa_backend.FlashAttnBackend(H200, fa_backend.Probe("fa4"))
    assert fa4.check(gemma) == [] and fa4.kv_cache_specs == ("full", "sliding_window")
    assert fa_backend.FlashAttnBackend(H200, fa_backend.Probe("fa2")).check(gemma) == [
        "block_size 128 is not a multiple of 256",
        "per-layer logits_soft_cap, scale, sliding_window unsupported (supports none)",
        "KV-cache spec sliding_window unsupported (serves full)",
    ]


def _table(rng: random.Random, seq_lens: list[int], block: int) -> torch.Tensor:
    nblocks = [-(-s // block) for s in seq_lens]
    ids = rng.sample(range(1, 1000), sum(nblocks))
    table = torch.zeros(len(seq_lens), max(nblocks) + 2, dtype=torch.int32)
    for b, n in enumerate(nblocks):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table


@pytest.mark.parametrize("block", [1, 16, 48])
def test_paged_indices_match_a_loop(block):
    rng = random.Random(block)
    seq_lens = [rng.randint(0, 200) for _ in range(7)] + [block, block + 1]
    table = _table(rng, [max(s, 1) for s in seq_lens], block)
    indptr, indices, last = fi_backend.paged_indices(torch.tensor(seq_lens, dtype=torch.int32), table, block)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    pages = [-(-s // block) for s in seq_lens]
    assert indptr.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
    assert indices[: indptr[-1]].tolist() == [int(table[b, i]) for b, n in enumerate(pages) for i in range(n)]
    assert last.tolist() == [s - (n - 1) * block if n else 0 for s, n in zip(seq_lens, pages)]


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("slots", [[5, 9, 2, 30], [5, -1, 9, -1, -1], [-1, -1, -1]])
def test_store_kv_writes_exactly_the_valid_slots(capturing, slots):
    """The eager path and the graph-safe path (used while capturing) leave the same cache."""
    t, hkv, d = len(slots), 2, 8
    slot_t = torch.tensor(slots)
    k, v = torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cache = torch.randn(2, 4, 8, hkv, d)
    expected = cache.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            expected[0].view(-1, hkv, d)[s], expected[1].view(-1, hkv, d)[s] = k[i], v[i]
    valid = slot_t >= 0
    rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)
    with NoHostSync() if capturing else contextlib.nullcontext():
        store_kv(cache, k, v, slot_t, rows, capturing)
    assert torch.equal(cache, expected)


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's value on the host (.item(), bool(t), t[0-dim index]): on CUDA
    each is a device sync, which a graph capture forbids. Lets the CPU suite check the graph-safe paths."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            raise AssertionError(f"host sync in a capturable path: {func}")
        return func(*args, **(kwargs or {}))


def test_no_host_sync_catches_a_zero_dim_index():
    t = torch.arange(4)
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        t[t.argmax()]


def test_paged_indices_and_static_refresh_do_not_sync():
    """What the first attention layer in a captured FlashInfer decode graph runs: the static decode
    buffers refilled from seq_lens / block_table, with no host read (refresh never touches the wrapper)."""
    meta = _meta([1, 1, 1, 1], [4, 16, 0, 32], block=16)  # seq_lens 5, 17, 1, 33
    b, w = meta.block_table.shape
    st = fi_backend._StaticDecode(None, *(torch.zeros(n, dtype=torch.int32) for n in (b + 1, b * w, b)))
    with NoHostSync():
        st.refresh(meta, 16)
    pages = [1, 2, 1, 3]
    assert st.indptr.tolist() == [0, 1, 3, 4, 7] and st.last_page_len.tolist() == [5, 1, 1, 1]
    table = meta.block_table.tolist()
    assert st.indices[:7].tolist() == [table[r][i] for r, n in enumerate(pages) for i in range(n)]


def _meta(qlens: list[int], ctxs: list[int], pad: int = 0, block: int = 16) -> AttentionMetadata:
    seq_lens = [c + q for c, q in zip(ctxs, qlens)]
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    n = sum(qlens)
    slots = torch.cat([torch.arange(n), torch.full((pad,), -1)])
    table = _table(random.Random(0), seq_lens, block)
    return AttentionMetadata(slots, cu, torch.tensor(seq_lens, dtype=torch.int32), table, max(qlens),
                             max(seq_lens), n)  # fmt: skip


def test_metadata_routes_uniform_decode_and_everything_else(flashinfer, flash_attn):
    decode, mixed, padded = (
        _meta([1, 1, 1], [5, 9, 30]),
        _meta([1, 7, 1], [5, 0, 30]),
        _meta([3, 1], [0, 4], pad=3),
    )
    # FlashInfer routes before it plans (planning needs the library); flash_attn's metadata is all torch
    spec = AttentionSpec(4, 2, 64, torch.bfloat16, 16, 0.125, num_layers=1)
    fa_build = fa_backend.FlashAttnMetadataBuilder(flash_attn, spec).build  # make_builder needs the library
    for build in (fi_backend.FlashInferMetadata.route, fa_build):
        md = [build(m) for m in (decode, mixed, padded)]
        assert [x.decode for x in md] == [True, False, False]
        assert md[0].store_rows is None and md[2].store_rows.tolist() == [0, 1, 2, 3]
    assert [fi_backend.FlashInferMetadata.route(m).rows for m in (decode, mixed, padded)] == [3, 9, 4]
    assert fa_build(mixed).cu_seqlens_k.tolist() == [0, 6, 13, 44]


def test_cudagraph_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TURNOUT_FLASHINFER_CUDAGRAPH / TURNOUT_FLASH_ATTN_CUDAGRAPH replace a declared level (to try a capture
    on a new library version, or to turn graphs off); a bad value is one line naming the variable."""
    from turnout.errors import ConfigError

    monkeypatch.setenv("TURNOUT_FLASHINFER_CUDAGRAPH", "never")
    assert fi_backend.FlashInferBackend().cudagraph_support == CudagraphSupport.NEVER
    monkeypatch.setenv("TURNOUT_FLASH_ATTN_CUDAGRAPH", "NEVER")
    fa4 = fa_backend.Probe("fa4")
    assert fa_backend.FlashAttnBackend(H200, fa4).cudagraph_support == CudagraphSupport.NEVER
    monkeypatch.delenv("TURNOUT_FLASH_ATTN_CUDAGRAPH")
    assert fa_backend.FlashAttnBackend(H200, fa4).cudagraph_support == CudagraphSupport.ALWAYS
    monkeypatch.setenv("TURNOUT_FLASHINFER_CUDAGRAPH", "sometimes")
    with pytest.raises(ConfigError, match=r"_CUDAGRAPH='SOMETIMES' is not .* NEVER, UNIFORM_DECODE"):
        fi_backend.FlashInferBackend()


def test_auto_runs_fa4_for_mixed_steps_beside_the_triton_decode_kernel():
    """turnout.Priority's mixed-step order on an H200: with FA4, "auto" runs triton for decode steps and
    flash_attn for the rest; on FA2 flash_attn ranks below triton for both, and triton serves alone. (The
    triton candidate is taken as valid: checking it would import its kernels outside the interpreter.)"""
    from turnout_triton.backend import TritonAttentionBackend

    from turnout.selection import Candidate, choose_attention

    c = ctx(block=None)

    def auto(path: str):
        fa = fa_backend.FlashAttnBackend(H200, fa_backend.Probe(path))
        cands = [Candidate("attention", b.name, b.name, int(b.priority), why, b)
                 for b, why in ((TritonAttentionBackend(), []), (fa, fa.check(c)))]  # fmt: skip
        return choose_attention(cands, "auto", c)

    att = auto("fa4")
    assert att.chosen.name == "triton+flash_attn"
    assert att.chosen.obj.preferred_block_size == 16  # the decode half's, which FA4 takes
    assert {p: h.name for p, h in att.phases.items()} == {"decode": "triton", "mixed": "flash_attn"}
    assert auto("fa2").chosen.name == "triton"


@pytest.mark.skipif(not NO_FLASH_ATTN, reason="FA4 installed: importing it here would load CUDA libraries")
def test_fa4_keeps_its_compiled_kernels_in_turnouts_cache(monkeypatch, tmp_path):
    """FA4 reads its persistent-cache switches when flash_attn.cute is imported: the probe sets them first,
    to a folder of turnout's cache, and leaves a user's own folder alone."""
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "tc"))
    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ImportError):
        fa_backend._import_fa4()
    cache = tmp_path / "tc" / "flash_attn_cute"
    assert cache.is_dir() and os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(cache)
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "mine"))
    with pytest.raises(ImportError):
        fa_backend._import_fa4()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_pair_takes_the_decode_halfs_block_size_where_the_mixed_half_takes_it():
    """Prefix hits count whole blocks: triton's 16 under FA4 (any size), FA2's 256 where it needs them."""
    from turnout_triton.backend import TritonAttentionBackend

    from turnout.attention.per_phase import PerPhaseBackend
    from turnout.config import EngineConfig
    from turnout.defaults import fit_defaults

    triton = TritonAttentionBackend()
    fa4 = fa_backend.FlashAttnBackend(H200, fa_backend.Probe("fa4"))
    fa2 = fa_backend.FlashAttnBackend(H200, fa_backend.Probe("fa2"))
    assert PerPhaseBackend(triton, fa4).preferred_block_size == 16
    assert PerPhaseBackend(fa4, triton).preferred_block_size == fa_backend.FA4_PAGE
    assert PerPhaseBackend(triton, fa2).preferred_block_size == fa_backend.FA2_BLOCK
    fitted = fit_defaults(EngineConfig(), H200, PerPhaseBackend(triton, fa4))["block_size"]
    why = "triton+flash_attn: the decode half triton's preferred KV block size, which both take"
    assert fitted == (16, why)
