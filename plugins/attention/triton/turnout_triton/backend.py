"""TritonAttentionBackend: paged attention with this package's own Triton kernels (turnout_triton.kernels).

triton is imported only when the backend is checked or runs. With TRITON_INTERPRET=1 set before that
import, the kernels run in Triton's interpreter, so the backend also serves the CPU (slowly: for tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from turnout import Priority
from turnout.attention import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    CudagraphSupport,
)

MAX_HEAD_SIZE = 256  # heads are padded to a power of two in registers; past 256 the tiles spill
MAX_KV_LORA_RANK = 512  # the latent layout's V part (DeepSeek's 512), padded likewise; its rope part apart


def _kernels() -> ModuleType:
    from turnout_triton import kernels

    return kernels


@dataclass
class TritonMetadata:
    """What every layer of a KV-cache group reads in a step, beyond AttentionMetadata."""

    split_counts: torch.Tensor  # the decode kernel's counters (kernels.split_counts), the builder's


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """One KV-cache group's decode split counters: one buffer for every layer of the group and every step,
    sized for the largest batch the graphs capture. A larger batch gets a larger buffer; those before it stay
    allocated, since a captured graph keeps the address it captured."""

    def __init__(self, backend: AttentionBackend, spec: AttentionSpec, group: int = 0) -> None:
        super().__init__(backend, spec, group)
        self._max_reqs = 0
        self._counts: list[torch.Tensor] = []

    def build(self, meta: AttentionMetadata) -> TritonMetadata:
        """The counters, for this step's batch; the kernels read everything else on the device."""
        n = max(meta.num_reqs, self._max_reqs) * self.spec.num_kv_heads
        if not self._counts or self._counts[-1].numel() < n:
            self._counts.append(_kernels().split_counts(n, meta.seq_lens.device))
        return TritonMetadata(self._counts[-1])

    def prepare_cudagraphs(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self._max_reqs = max_num_reqs


class TritonAttentionImpl(AttentionImpl):
    """One layer's paged attention: one kernels.paged_attention call with the layer's features."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]; MLA: no leading 2
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        kn, layer = _kernels(), self.layer
        # A captured graph replays with other lengths: the model runner captures with max_seq_len at its
        # largest (max_model_len), and any split count that covers the lengths gives the same bits.
        splits = kn.num_splits(meta.max_seq_len)
        lens = (meta.query_start_loc, meta.seq_lens, meta.block_table)
        counts = meta.backend_data.split_counts
        return kn.paged_attention(
            q, k, v, kv_cache, meta.slot_mapping, *lens, layer.scale, meta.max_query_len, splits, counts,
            sliding_window=layer.sliding_window, logits_soft_cap=layer.logits_soft_cap,
            k_scale=layer.k_scale, v_scale=layer.v_scale, kv_lora_rank=self.spec.kv_lora_rank,
            num_decode_tokens=meta.num_decode_tokens,
        )  # fmt: skip


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with this package's Triton kernels, for any batch (module docstring)."""

    name = "triton"
    priority = Priority.FIRST  # the order per platform: turnout.Priority
    mixed_priority = Priority.SECOND
    device_types = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)  # float32 dots run in IEEE precision
    head_sizes = None  # any size up to MAX_HEAD_SIZE, see check()
    block_size_multiple = 1  # keys are found one by one through block_table: any block size works
    min_capability = (8, 0)
    # Kernels read lengths, offsets and block ids on the device; no host planning. Grids come from tensor
    # shapes (T, B, num_kv_heads) and a split count from max_seq_len, which the model runner sets to
    # max_model_len while capturing; any covering split count gives the same bits. So a graph captured on
    # static metadata buffers replays any batch of those shapes exactly as an eager step computes it, with one
    # rule, as in vLLM: max_query_len at capture picks the kernels. Captured with max_query_len == 1, the
    # graph serves decode-only batches; captured with max_query_len > 1, it serves any batch.
    cudagraph_support = CudagraphSupport.ALWAYS
    # a sliding window and a soft-cap compile their own kernel variants (constexpr), one per value
    attention_features = frozenset(LAYER_FEATURES)
    kv_cache_dtypes = ("auto", "fp8")  # FP8: e4m3 stores, tiles read as stored * scale (kernels.py)
    # a window reads only its blocks (nulled ones never); "mla": the latent layout of kernels.py
    kv_cache_specs = ("full", "sliding_window", "mla")
    builder_cls = TritonMetadataBuilder
    impl_cls = TritonAttentionImpl

    def __init__(self) -> None:
        if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter runs every kernel on the host
            self.device_types = ("cuda", "cpu")
            self.min_capability = None
            self.priority = self.mixed_priority = Priority.TESTING  # never preferred over a native backend

    def import_error(self) -> str | None:
        try:
            kn = _kernels()
        except ImportError as e:
            return f"cannot import triton: {e}"
        if "cpu" in self.device_types and not kn.INTERPRET:
            return "turnout_triton.kernels was imported before TRITON_INTERPRET=1 was set"
        return None

    def check(self, ctx: AttentionContext) -> list[str]:
        reasons = super().check(ctx)
        if ctx.kv_lora_rank:
            rope = ctx.head_size - ctx.kv_lora_rank
            if ctx.kv_lora_rank > MAX_KV_LORA_RANK or rope > MAX_HEAD_SIZE:
                limits = f"at most {MAX_KV_LORA_RANK} + {MAX_HEAD_SIZE}"
                reasons.insert(0, f"MLA latent {ctx.kv_lora_rank} + {rope} unsupported ({limits})")
        elif ctx.head_size > MAX_HEAD_SIZE:
            reasons.insert(0, f"head size {ctx.head_size} unsupported (at most {MAX_HEAD_SIZE})")
        return reasons
