"""FlashAttnBackend: paged attention with FlashAttention, through whichever of two libraries fits, chosen when
the backend is checked (TURNOUT_FLASH_ATTN=2 or 4 forces one):

  - FlashAttention-4 (`flash-attn-4`: flash_attn.cute.flash_attn_varlen_func) on compute capability 9.x-11.x
    (its SM80 and SM120 kernels have no paged KV). One call per layer for any batch, with cu_seqlens_q,
    seqused_k=seq_lens and page_table=block_table. Any block size: a page of exactly one key tile (128 keys
    for head sizes up to 128) loads by TMA, which also reads the unused rows of a request's last page (they
    must hold finite values: zeros from allocation or stale keys are fine); other sizes load row by row
    through cp.async. Head sizes: multiples of 16 (the paged loaders refuse padded head dims), up to 256 on
    SM90, up to 128 or exactly 256 on SM100/110. No host lengths are passed (max_seqlen_q/k default to shape
    bounds), so a launch depends on shapes alone and reads lengths and page ids on the device: ALWAYS. A
    capture on the H200 had failed (cudaErrorStreamCaptureInvalidated, 2026-11-29) because the shared KV
    write synchronised with the host (fixed in 86da22d); since then FULL graphs of mixed and decode batches
    give outputs identical to eager in all five modes, and the conformance replay test passes
    (benchmarks/results/2026-11-30-h200-graphs-fa4-flashinfer-five-modes.json). TURNOUT_FLASH_ATTN_CUDAGRAPH
    overrides the level.
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
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnout import Priority
from turnout.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    AttentionMetadata,
    CudagraphSupport,
)
from turnout.attention.kv_store import store_kv, valid_rows
from turnout.platform import Platform

NOT_INSTALLED = "flash_attn is not installed (pip install turnout-flash-attn[fa2] or flash-attn-4 on SM90+)"
FA2_BLOCK = 256
SUPPORT = {"fa4": CudagraphSupport.ALWAYS, "fa2": CudagraphSupport.UNIFORM_BATCH}


@dataclass(frozen=True)
class Probe:
    """What was found for one compute capability: a usable path, or why there is none."""

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
    """The constraints that depend on the library: block size (FA2) and head size."""
    d, bs = ctx.head_size, ctx.block_size
    reasons = []
    if path == "fa2":
        if bs % FA2_BLOCK:
            reasons.append(f"FA2 paged KV needs block_size a multiple of {FA2_BLOCK}, got {bs}")
        if d > 256 or d % 8:
            reasons.append(f"FA2 needs head size a multiple of 8 up to 256, got {d}")
    elif path == "fa4":
        sm90 = (ctx.platform.capability or (9, 0))[0] == 9
        if d % 16 or not (16 <= d <= 256 if sm90 else d <= 128 or d == 256):
            most = "256" if sm90 else "128 (or exactly 256)"
            reasons.append(f"FA4 paged KV needs head size a multiple of 16 up to {most}, got {d}")
    return reasons


def _cu_seqlens(seq_lens: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))  # [B + 1]


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    priority = Priority.FIRST  # the order per platform: turnout.Priority
    device_types = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_sizes = None  # depends on the library: path_reasons()
    block_size_multiple = 1  # 256 once FA2 is the path
    min_capability = (8, 0)
    cudagraph_support = CudagraphSupport.NEVER  # set by the path: SUPPORT

    def __init__(self, platform: Platform | None = None) -> None:
        self._platform = platform
        self._probes: dict[tuple, Probe] = {}
        self.probe: Probe | None = None

    def use(self, p: Probe) -> None:
        """Adopt a probe result: the path's constraints become this backend's declared ones."""
        self.probe = p
        self.block_size_multiple = FA2_BLOCK if p.path == "fa2" else 1
        self.min_capability = (9, 0) if p.path == "fa4" else (8, 0)
        level = SUPPORT.get(p.path, CudagraphSupport.NEVER)
        self.cudagraph_support = CudagraphSupport.from_env("TURNOUT_FLASH_ATTN_CUDAGRAPH", level)

    def _select(self, capability: tuple[int, int] | None) -> Probe:
        key = (capability, os.environ.get("TURNOUT_FLASH_ATTN", "").strip())
        if key not in self._probes:
            self._probes[key] = probe(*key)
        self.use(self._probes[key])
        return self._probes[key]

    def import_error(self) -> str | None:
        if self.probe is None:
            self._select(self._platform.capability if self._platform else None)
        return self.probe.error

    def check(self, ctx: AttentionContext) -> list[str]:
        cuda = ctx.platform.device_type in self.device_types
        if cuda:
            self._select(ctx.platform.capability)
        generic = f"block_size {ctx.block_size} is not a multiple of {self.block_size_multiple}"
        reasons = [r for r in super().check(ctx) if r != generic]  # path_reasons says it precisely
        return reasons + (path_reasons(self.probe.path, ctx) if cuda and self.probe else [])

    def build_metadata(self, meta: AttentionMetadata) -> FlashAttnMetadata:
        rows = valid_rows(meta.slot_mapping)
        return FlashAttnMetadata(rows, meta.uniform_decode, _cu_seqlens(meta.seq_lens))

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        md: FlashAttnMetadata = meta.backend_data
        p = self.probe if self.probe and self.probe.path else self._select(torch.cuda.get_device_capability())
        if p.path is None:
            raise RuntimeError(f"flash_attn backend cannot run: {p.error}")
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        store_kv(kv_cache, k, v, meta.slot_mapping, md.store_rows, capturing)
        kc, vc = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        if p.path == "fa4":
            out = p.varlen(
                q, kc, vc, cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
                page_table=meta.block_table, softmax_scale=layer.scale, causal=True,
            )  # fmt: skip
            return out[0] if isinstance(out, tuple) else out  # (out, lse)
        if md.decode:
            b = meta.num_reqs
            o = p.kvcache(
                q[:b].unsqueeze(1), kc, vc, cache_seqlens=meta.seq_lens, block_table=meta.block_table,
                softmax_scale=layer.scale, causal=True,
            ).squeeze(1)  # fmt: skip
            if b == q.shape[0]:
                return o
            out = q.new_zeros(q.shape)
            out[:b] = o
            return out
        # While capturing, bounds that hold for any batch of these shapes; lengths come from the device.
        cu_k = _cu_seqlens(meta.seq_lens) if capturing else md.cu_seqlens_k
        max_k = meta.block_table.shape[1] * kc.shape[1] if capturing else meta.max_seq_len
        # max_seqlen_q == 1 would make FA2 pack GQA heads by reshaping q to [B, ...], which needs T == B;
        # 2 is a valid bound for any batch.
        return p.varlen(
            q, kc, vc, meta.query_start_loc, cu_k, max(meta.max_query_len, 2), max_k,
            softmax_scale=layer.scale, causal=True, block_table=meta.block_table,
        )  # fmt: skip
