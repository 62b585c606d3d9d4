"""FlashAttnBackend: paged attention with FlashAttention, through whichever of two libraries fits, found when
the plugin offers the backend on a CUDA platform (TURNOUT_FLASH_ATTN=2 or 4 forces one). The library found
fixes the backend's declared block_size_multiple and cudagraph_support for its lifetime:

  - FlashAttention-4 (`flash-attn-4`: flash_attn.cute.flash_attn_varlen_func) on compute capability 9.x-11.x
    (its SM80 and SM120 kernels have no paged KV). One call per layer for any batch, with cu_seqlens_q,
    seqused_k=seq_lens and page_table=block_table. Any block size: a page of exactly one key tile (128 keys
    for head sizes up to 128) loads by TMA, which also reads the unused rows of a request's last page (they
    must hold finite values: zeros from allocation or stale keys are fine); other sizes load row by row
    through cp.async. Head sizes: multiples of 16 (the paged loaders refuse padded head dims), up to 256 on
    SM90, up to 128 or exactly 256 on SM100/110. No host lengths are passed (max_seqlen_q/k default to shape
    bounds), so a launch depends on shapes alone and reads lengths and page ids on the device: ALWAYS, given
    a KV write that does not read the device on the host while captured (store_kv's capture path). The GPU
    conformance suite replays a FULL capture against eager (test_cudagraph_replay).
    TURNOUT_FLASH_ATTN_CUDAGRAPH overrides the level.
  - FlashAttention 2 (`flash-attn` 2.x) on SM80+: flash_attn_with_kvcache for uniform-decode batches,
    flash_attn_varlen_func(block_table=...) for the others. Its paged KV needs block_size % 256 == 0; head
    sizes are multiples of 8 up to 256. UNIFORM_BATCH, as vLLM declares FA2: which call (and, for decode,
    FA2's packing of GQA heads into the query length) is decided on the host, so a graph captured on a
    uniform batch serves only uniform batches of that shape.

KV layout: the default [2, num_blocks, block_size, num_kv_heads, head_size]; both libraries read kv_cache[0]
and kv_cache[1] as [num_blocks, block_size, num_kv_heads, head_size] paged caches. k and v are written
through slot_mapping in torch (slot -1 writes nowhere) before attention. Output rows past
query_start_loc[-1] (graph padding) may be left unwritten.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import turnout
from turnout import Platform, Priority
from turnout.attention import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    CudagraphSupport,
    store_kv,
    valid_rows,
)
from turnout_flash_attn.envs import CUDAGRAPH, FLASH_ATTN

logger = logging.getLogger("turnout")

NOT_INSTALLED = "flash_attn is not installed (pip install turnout-flash-attn[fa2] or flash-attn-4 on SM90+)"
FA2_BLOCK = 256
FA4_PAGE = 128
SUPPORT = {"fa4": CudagraphSupport.ALWAYS, "fa2": CudagraphSupport.UNIFORM_BATCH}


@dataclass(frozen=True)
class Probe:
    """What is installed for one compute capability: a usable path, or why there is none."""

    path: str | None  # "fa4", "fa2" or None
    error: str | None = None
    varlen: Callable | None = None  # the library's flash_attn_varlen_func
    kvcache: Callable | None = None  # FA2's flash_attn_with_kvcache


@dataclass
class FlashAttnMetadata:
    store_rows: torch.Tensor | None  # [n] token rows with a slot >= 0; None when every slot is valid
    decode: bool  # every request runs one token (FA2 takes flash_attn_with_kvcache)
    cu_seqlens_k: torch.Tensor  # [B + 1] int32 (FA2's varlen call)


class _WrongVersion(Exception):
    pass


def _import_fa4() -> Callable:
    # FA4 compiles each kernel variant on its first call, seconds apiece; its persistent cache (read when
    # flash_attn.cute is imported) keeps them beside turnout's other caches for later processes
    cache = turnout.cache_dir() / "flash_attn_cute"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("FA4 compiles its kernels again in each process: cannot make %s (%s)", cache, e)
    else:
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(cache))
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def _import_fa2() -> tuple[Callable, Callable]:
    import flash_attn

    version = getattr(flash_attn, "__version__", "")  # FA4 alone leaves flash_attn a namespace package
    if not version.startswith("2."):
        raise _WrongVersion(version)
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    return flash_attn_varlen_func, flash_attn_with_kvcache


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _attempt(fn: Callable, label: str) -> tuple[object, str | None]:
    """(fn(), None), or (None, "missing") when the module is absent, or (None, why it is unusable)."""
    try:
        return fn(), None
    except _WrongVersion as e:
        if not str(e):
            return None, "missing"
        return None, f"flash_attn {e} is installed; this backend drives 2.x (or flash-attn-4 on SM90+)"
    except ModuleNotFoundError as e:
        if e.name in ("flash_attn", "flash_attn.cute"):
            return None, "missing"
        return None, f"cannot import {label}: {e}"
    except Exception as e:  # a CUDA extension or the CuTe DSL failing to load
        return None, f"cannot import {label}: {type(e).__name__}: {e}"


def probe(capability: tuple[int, int] | None, force: str = "") -> Probe:
    """FA4 where it has paged KV (SM90-SM110) and imports, else FA2; force "2" or "4" allows only that one."""
    why = []
    if force != "2":
        if capability is not None and 9 <= capability[0] <= 11:
            fn, err = _attempt(_import_fa4, "flash_attn.cute (FA4)")
            if fn is not None:
                return Probe("fa4", varlen=fn)
            if err != "missing":
                why.append(err)
            elif force == "4":
                why.append("flash-attn-4 is not installed (pip install flash-attn-4)")
        elif force == "4" or _dist_version("flash-attn-4"):
            have = "%d.%d" % capability if capability else "none"
            if capability and capability[0] >= 12:
                why.append(f"FA4 has no paged KV on compute capability {have}")
            else:
                why.append(f"FA4 needs compute capability >= 9.0, have {have}")
    if force != "4":
        fns, err = _attempt(_import_fa2, "flash_attn (FA2)")
        if fns is not None:
            varlen, kvcache = fns
            return Probe("fa2", varlen=varlen, kvcache=kvcache)
        if err != "missing":
            why.append(err)
        elif why or force == "2":
            why.append("flash_attn 2.x is not installed (pip install turnout-flash-attn[fa2])")
    return Probe(None, "; ".join(why) or NOT_INSTALLED)


def path_reasons(path: str | None, ctx: AttentionContext) -> list[str]:
    """The head sizes the library takes (its block sizes are the declared block_size_multiple)."""
    d = ctx.head_size
    if path == "fa2" and (d > 256 or d % 8):
        return [f"FA2 needs head size a multiple of 8 up to 256, got {d}"]
    if path == "fa4":
        sm90 = (ctx.platform.capability or (9, 0))[0] == 9
        if d % 16 or not (16 <= d <= 256 if sm90 else d <= 128 or d == 256):
            most = "256" if sm90 else "128 (or exactly 256)"
            return [f"FA4 paged KV needs head size a multiple of 16 up to {most}, got {d}"]
    return []


def _cu_seqlens(seq_lens: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))  # [B + 1]


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    """One KV-cache group's FlashAttnMetadata a step."""

    def build(self, meta: AttentionMetadata) -> FlashAttnMetadata:
        """The rows to store, the call FA2 takes, and FA2's cu_seqlens_k."""
        rows = valid_rows(meta.slot_mapping)
        return FlashAttnMetadata(rows, meta.uniform_decode, _cu_seqlens(meta.seq_lens))


class FlashAttnImpl(AttentionImpl):
    """One layer: writes its KV cache, then one FA4 call, or FA2's decode or varlen call."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        md: FlashAttnMetadata = meta.backend_data
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        store_kv(kv_cache, k, v, meta.slot_mapping, md.store_rows, capturing)
        kc, vc = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        if self.backend.probe.path == "fa4":
            return self._fa4(q, kc, vc, meta, self.layer)
        if md.decode:
            return self._fa2_decode(q, kc, vc, meta)
        return self._fa2_varlen(q, kc, vc, meta, md, capturing)

    def _fa4(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:
        """Any batch in one call; lengths and pages are read on the device. FA4's window (left, right) keeps
        keys in [p - left, p + right]: a sliding window W is (W - 1, 0)."""
        window = (layer.sliding_window - 1, 0) if layer.sliding_window else (None, None)
        out = self.backend.probe.varlen(
            q, kc, vc, cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
            page_table=meta.block_table, softmax_scale=layer.scale, causal=True,
            window_size=window, softcap=layer.logits_soft_cap or 0.0,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out  # (out, lse)

    def _fa2_decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Uniform decode: one query token per request, rows [0, B) of q."""
        b = meta.num_reqs
        o = self.backend.probe.kvcache(
            q[:b].unsqueeze(1), kc, vc, cache_seqlens=meta.seq_lens, block_table=meta.block_table,
            softmax_scale=self.spec.scale, causal=True,
        ).squeeze(1)  # fmt: skip
        if b == q.shape[0]:
            return o
        out = q.new_zeros(q.shape)
        out[:b] = o
        return out

    def _fa2_varlen(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: AttentionMetadata,
        md: FlashAttnMetadata,
        capturing: bool,
    ) -> torch.Tensor:
        """Any other batch. While capturing, bounds that hold for any batch of these shapes; lengths come
        from the device."""
        cu_k = _cu_seqlens(meta.seq_lens) if capturing else md.cu_seqlens_k
        max_k = meta.block_table.shape[1] * kc.shape[1] if capturing else meta.max_seq_len
        # max_seqlen_q == 1 would make FA2 pack GQA heads by reshaping q to [B, ...], which needs T == B;
        # 2 is a valid bound for any batch.
        return self.backend.probe.varlen(
            q, kc, vc, meta.query_start_loc, cu_k, max(meta.max_query_len, 2), max_k,
            softmax_scale=self.spec.scale, causal=True, block_table=meta.block_table,
        )  # fmt: skip


class FlashAttnBackend(AttentionBackend):
    """Paged attention with FlashAttention 4 or 2, whichever the probe found (module docstring)."""

    name = "flash_attn"
    priority = Priority.THIRD  # the order per platform: turnout.Priority
    device_types = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_sizes = None  # depends on the library: path_reasons()
    min_capability = (8, 0)
    # FA4 attends with each layer's scale, window and soft-cap, one block table per KV-cache group; FA2 with
    # spec.scale alone over full-attention groups (set in __init__)
    attention_features = frozenset(LAYER_FEATURES)
    builder_cls = FlashAttnMetadataBuilder
    impl_cls = FlashAttnImpl

    def __init__(self, platform: Platform | None = None, found: Probe | None = None) -> None:
        """found: the library to drive; by default probed here, once, on a CUDA platform."""
        if found is None:
            cuda = platform is not None and platform.device_type == "cuda"
            force = FLASH_ATTN.value
            found = probe(platform.capability, force) if cuda else Probe(None, "needs a CUDA device")
        self.probe = found
        self.block_size_multiple = FA2_BLOCK if found.path == "fa2" else 1
        # FA4 loads a page of one 128-key tile by TMA; smaller pages load row by row
        self.preferred_block_size = {"fa2": FA2_BLOCK, "fa4": FA4_PAGE}.get(found.path, 16)
        if found.path == "fa4":
            self.min_capability = (9, 0)
            self.mixed_priority = Priority.FIRST
            self.kv_cache_specs = ("full", "sliding_window")  # the window skips the freed (null) blocks
        else:
            self.attention_features = frozenset()
        level = SUPPORT.get(found.path, CudagraphSupport.NEVER)
        self.cudagraph_support = CudagraphSupport.from_env(CUDAGRAPH, level)

    def import_error(self) -> str | None:
        return self.probe.error

    def check(self, ctx: AttentionContext) -> list[str]:
        reasons = super().check(ctx)
        if ctx.platform.device_type in self.device_types:
            reasons += path_reasons(self.probe.path, ctx)
        return reasons

    def make_builder(self, spec: AttentionSpec, group: int = 0) -> AttentionMetadataBuilder:
        self._require_library()
        return super().make_builder(spec, group)

    def make_impl(self, spec: AttentionSpec, layer: AttentionLayerSpec) -> AttentionImpl:
        self._require_library()
        return super().make_impl(spec, layer)

    def _require_library(self) -> None:
        if self.probe.path is None:
            raise RuntimeError(f"flash_attn backend cannot run: {self.probe.error}")
