"""FlashInferBackend: paged attention through FlashInfer's batch wrappers (flashinfer-python 0.6).

KV layout: the default [2, num_blocks, block_size, num_kv_heads, head_size]; (kv_cache[0], kv_cache[1]) is
FlashInfer's NHD (k_cache, v_cache) tuple with one page per block, so any block size is a page size. k and v
are written through slot_mapping in torch (slot -1 writes nowhere) before attention.

One plan per step and KV-cache group, not per layer. A plan needs the head counts, head size, dtype, scale
and block size: the AttentionSpec the group's FlashInferMetadataBuilder is made with. Its build turns
seq_lens / block_table into FlashInfer's paged indices (kv_indptr, kv_indices, kv_last_page_len:
vectorised, fixed shapes) and plans one of the builder's wrappers, which FlashInferImpl runs for each layer:
  - uniform decode (every request runs one token): a BatchDecodeWithPagedKVCacheWrapper per batch size, made
    in CUDA-graph mode on fixed index buffers, with tensor cores, FA2 kernels and split-KV off. Its plan
    depends on the batch size alone: lengths and page ids are read on the device.
  - any other batch (the model runner does not reorder requests, so decode rows may sit anywhere): one
    BatchPrefillWithPagedKVCacheWrapper, causal, over every request. Its kernels are FlashInfer's FA2 ones
    too, so prefill and decode share one JIT module per (dtype, head size);
    TURNOUT_FLASHINFER_PREFILL_BACKEND=auto picks FA3 on SM90 instead (faster prefill, a second JIT module).
A builder's wrappers share its one 512 MiB float workspace.

CUDA graphs (UNIFORM_DECODE). Capturing a uniform-decode batch needs:
  1. static metadata tensors (slot_mapping, query_start_loc, seq_lens, block_table of a fixed width) that are
     refilled in place before each replay, with num_reqs == tokens == the captured size (padding tokens are
     padding requests: slot -1, any seq_len >= 0);
  2. the builder's prepare_cudagraphs(max_blocks_per_req) once, so the decode wrappers' page-index buffers
     fit the widest block_table; then per captured size build on the static tensors and one eager forward
     (JIT compile) before torch.cuda.graph(...);
  3. nothing per replay: the first attention layer in the graph recomputes the paged indices from seq_lens /
     block_table into the wrapper's fixed buffers. Calling build before a replay also works (it re-plans
     the same buffers with the same schedule).
Mixed batches cannot be captured (planning reads lengths on the host): trying raises.
TURNOUT_FLASHINFER_CUDAGRAPH=NEVER turns graphs around FlashInfer off (PIECEWISE then runs it eagerly in
the holes).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from turnout import Priority
from turnout.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    CudagraphSupport,
    store_kv,
    valid_rows,
)
from turnout_flashinfer.envs import CUDAGRAPH, PREFILL_BACKEND

WORKSPACE_BYTES = 512 << 20  # float workspace shared by every wrapper; 128 MiB is too small for long prefills
MIN_VERSION = (0, 6)


def _flashinfer() -> ModuleType:
    import flashinfer

    return flashinfer


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())


@dataclass
class _StaticDecode:
    """A CUDA-graph-mode decode wrapper for one batch size, and the fixed buffers its kernels read."""

    wrapper: Any
    indptr: torch.Tensor  # [B + 1] int32
    indices: torch.Tensor  # [capacity] int32
    last_page_len: torch.Tensor  # [B] int32
    captured: bool = False

    def refresh(self, meta: AttentionMetadata, block_size: int) -> None:
        indptr, indices, last = paged_indices(meta.seq_lens, meta.block_table, block_size)
        self.indptr.copy_(indptr)
        self.indices[: indices.numel()].copy_(indices)
        self.last_page_len.copy_(last)


@dataclass
class FlashInferMetadata:
    decode: bool  # uniform decode: the static decode wrapper; otherwise the prefill wrapper
    rows: int  # query rows the wrapper runs: num_reqs (decode) or num_actual_tokens
    store_rows: torch.Tensor | None  # [n] token rows with a slot >= 0; None when every slot is valid
    wrapper: Any = None  # planned for this step by the builder
    static: _StaticDecode | None = None
    refreshed: bool = False  # the current capture already recomputes the static page indices

    @classmethod
    def route(cls, meta: AttentionMetadata) -> FlashInferMetadata:
        """Which wrapper a step takes and how many rows it runs, before any plan."""
        decode = meta.uniform_decode
        rows = meta.num_reqs if decode else meta.num_actual_tokens
        return cls(decode, rows, valid_rows(meta.slot_mapping))


def paged_indices(
    seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """seq_lens [B], block_table [B, W] -> FlashInfer's kv_indptr [B + 1], kv_indices [B * W] (the first
    kv_indptr[-1] are real) and kv_last_page_len [B], int32 on the device. Fixed shapes: capturable."""
    b, w = block_table.shape
    dev = seq_lens.device
    # [B]; a capture's dummy seq_lens may reach past the table's width: the clamp keeps dst in range
    pages = ((seq_lens + block_size - 1) // block_size).clamp(max=w)
    indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(pages, 0)
    col = torch.arange(w, device=dev)
    dst = torch.where(col < pages[:, None], indptr[:-1, None] + col, b * w)  # [B, W]; b * w: a dump slot
    indices = torch.zeros(b * w + 1, dtype=torch.int32, device=dev)
    indices.scatter_(0, dst.flatten(), block_table.flatten().to(torch.int32))
    last = torch.where(seq_lens > 0, (seq_lens - 1) % block_size + 1, 0).to(torch.int32)
    return indptr, indices[: b * w], last


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """One KV-cache group's wrappers, their workspace and fixed page-index buffers; plans one a step."""

    def __init__(self, backend: AttentionBackend, spec: AttentionSpec, group: int = 0) -> None:
        super().__init__(backend, spec, group)
        self._workspace: torch.Tensor | None = None
        self._prefill: Any = None
        self._decode: dict[int, _StaticDecode] = {}  # batch size -> wrapper
        self._retired: list[_StaticDecode] = []  # replaced, but a captured graph still reads their buffers
        self._graph_width = 0

    def prepare_cudagraphs(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        """Before capturing: size the decode wrappers' page-index buffers for block tables this wide."""
        self._graph_width = max_blocks_per_req
        for b, st in list(self._decode.items()):
            if st.indices.numel() < b * max_blocks_per_req and not st.captured:
                del self._decode[b]

    def build(self, meta: AttentionMetadata) -> FlashInferMetadata:
        """The step's paged indices, and the wrapper that serves it planned on them."""
        md = FlashInferMetadata.route(meta)
        spec = self.spec
        indptr, indices, last = paged_indices(meta.seq_lens, meta.block_table, spec.block_size)
        shape = (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size)
        kw = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.scale)
        if md.decode:
            st = self._static_decode(meta.num_reqs, meta.block_table.shape[1], indptr.device)
            st.wrapper.plan(indptr, indices, last, *shape, disable_split_kv=True, **kw)
            md.static, md.wrapper = st, st.wrapper
        else:
            md.wrapper = self._prefill_wrapper(indptr.device)
            md.wrapper.plan(meta.query_start_loc, indptr, indices, last, *shape, causal=True, **kw)
        return md

    def _float_workspace(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            with torch.inference_mode(False):
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _prefill_wrapper(self, device: torch.device) -> Any:
        if self._prefill is None:
            backend = PREFILL_BACKEND.value
            with torch.inference_mode(False):
                ws = self._float_workspace(device)
                self._prefill = _flashinfer().BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        return self._prefill

    def _static_decode(self, b: int, width: int, device: torch.device) -> _StaticDecode:
        st = self._decode.get(b)
        if st is not None and st.indices.numel() >= b * width:
            return st
        if st is not None and st.captured:
            self._retired.append(st)
        w = max(width, self._graph_width, 1)
        cap = b * (1 << (w - 1).bit_length())  # widths grow: round up to a power of two
        with torch.inference_mode(False):
            ws = self._float_workspace(device)
            indptr, indices, last = (
                torch.zeros(n, dtype=torch.int32, device=device) for n in (b + 1, cap, b)
            )
            wrapper = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last, backend="fa2",
            )  # fmt: skip
            # The default int workspace is 8 MiB (and as much pinned) per wrapper; a decode plan of B requests
            # needs a few hundred bytes plus ~60 B per request.
            wrapper.reset_workspace_buffer(
                ws, torch.zeros((64 << 10) + 64 * b, dtype=torch.uint8, device=device)
            )
            # In CUDA-graph mode the plan pads its work list to a fixed grid and leaves the padding entries of
            # the (uninitialised) pinned buffer as they are: zeros make padding CTAs redo request 0's tile
            # (same values written twice) instead of reading garbage request ids.
            pinned = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)  # 0.6's name for it
            if pinned is not None:
                pinned.zero_()
        st = _StaticDecode(wrapper, indptr, indices, last)
        self._decode[b] = st
        return st


class FlashInferImpl(AttentionImpl):
    """One layer: writes its KV cache, then runs the wrapper its group's builder planned for the step."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,  # backend_data: the FlashInferMetadata the group's builder planned
    ) -> torch.Tensor:
        md: FlashInferMetadata = meta.backend_data
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        store_kv(kv_cache, k, v, meta.slot_mapping, md.store_rows, capturing)
        if capturing:
            if md.static is None:
                raise RuntimeError("flashinfer: only uniform-decode batches can be captured (UNIFORM_DECODE)")
            md.static.captured = True
            if not md.refreshed:
                md.static.refresh(meta, self.spec.block_size)
                md.refreshed = True
        else:
            md.refreshed = False
        n = md.rows
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        md.wrapper.run(q[:n], (kv_cache[0], kv_cache[1]), out=out[:n])
        if n < q.shape[0]:  # graph padding
            out[n:].zero_()
        return out


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer's batch wrappers (module docstring)."""

    name = "flashinfer"
    priority = Priority.SECOND  # the order per platform: turnout.Priority
    mixed_priority = Priority.THIRD
    device_types = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_sizes = (64, 128, 256)  # FA3's static_assert (hopper/prefill_sm90.cuh); FA2 builds these too
    block_size_multiple = 1  # a block is a page; FlashInfer takes any page size
    min_capability = (8, 0)
    cudagraph_support = CudagraphSupport.UNIFORM_DECODE  # static decode buffers (module docstring)
    # none: one plan per step for every layer, at spec.scale, without a window or soft-cap
    attention_features = frozenset()
    builder_cls = FlashInferMetadataBuilder
    impl_cls = FlashInferImpl

    def __init__(self) -> None:
        self.cudagraph_support = CudagraphSupport.from_env(CUDAGRAPH, self.cudagraph_support)

    def import_error(self) -> str | None:
        try:
            fi = _flashinfer()
        except ModuleNotFoundError as e:
            if e.name == "flashinfer":
                return "flashinfer is not installed (pip install flashinfer-python)"
            return f"cannot import flashinfer: {e}"
        except Exception as e:  # the JIT toolchain or a CUDA library failing to load
            return f"cannot import flashinfer: {type(e).__name__}: {e}"
        version = getattr(fi, "__version__", "0")
        if _version(version) < MIN_VERSION:
            return f"flashinfer {version} is too old (needs >= %d.%d)" % MIN_VERSION
        return None
