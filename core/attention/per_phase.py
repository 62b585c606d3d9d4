"""Attention per phase: one backend for decode steps, another for prefill steps.

The attention twin of FULL_AND_PIECEWISE's (decode, mixed) pair. A step whose tokens are mostly decode
rows goes to `decode`: uniform decode (max_query_len == 1: eager decode steps and the FULL uniform-decode
graphs, which are captured with it), and a mixed step whose leading decode rows are at least half its
tokens, as in wide decode, where short prompts join hundreds of decoding requests. Every backend serves any
batch, and a decode kernel reads each row's KV once where a prefill kernel tiles rows as queries. Prefill,
chunked-prefill and the other mixed steps go to `mixed`. PerPhaseBackend composes the two: its builder is
both halves' builders, of which the step's phase picks one, and each layer's impl holds both halves' impls.
Both halves read and write one KV cache, so they must declare the same kv_cache_shape, and block_size must
suit both. Graph support: FULL on uniform decode follows `decode`'s level; FULL on mixed batches is never
replayed, since a captured mixed graph would fix one half for batches that choose per step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from turnout.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    CudagraphSupport,
)

SEPARATOR = "+"


def split_name(name: str) -> tuple[str, str] | None:
    """'decode+mixed' -> (decode, mixed); None for a single backend's name."""
    if SEPARATOR not in name:
        return None
    decode, _, mixed = name.partition(SEPARATOR)
    return decode.strip(), mixed.strip()


def phase_support(decode: CudagraphSupport) -> CudagraphSupport:
    """The level the pair can replay, on the scale the graph downgrade rules read: FULL uniform decode
    runs `decode` and needs it at UNIFORM_DECODE or more. A mixed batch picks its half from its rows
    (decode_step), which a captured graph cannot, so the pair never reaches ALWAYS."""
    if decode < CudagraphSupport.UNIFORM_DECODE:
        return CudagraphSupport.NEVER
    return CudagraphSupport.UNIFORM_DECODE


def decode_step(meta: AttentionMetadata) -> bool:
    """Whether a step is `decode`'s: every request runs one token, or the leading decode rows are at least
    half of its tokens."""
    return meta.max_query_len == 1 or 2 * meta.num_decode_tokens >= meta.num_actual_tokens


def pair_block_size(decode: AttentionBackend, mixed: AttentionBackend) -> tuple[int, str | None]:
    """(the KV block size of a decode+mixed pair, the phase whose preference it is): decode's where mixed
    takes it, since prefix hits and the tail a request leaves unused in its last block are counted in whole
    blocks (at the Qwen3-8B shape, FA4's 128-token blocks against triton's 16: 87.5% of a repeat's prompt
    tokens hit instead of 98.4%, and wide decode preempts where 16 fits every request); else mixed's where
    decode takes it; else (None) the smallest size both take."""
    multiple = math.lcm(decode.block_size_multiple, mixed.block_size_multiple)
    for phase, backend in (("decode", decode), ("mixed", mixed)):
        if backend.preferred_block_size % multiple == 0:
            return backend.preferred_block_size, phase
    return multiple, None


class PerPhaseBuilder(AttentionMetadataBuilder):
    """Both halves' builders of one KV-cache group; a step is built by its phase's."""

    def __init__(self, decode: AttentionMetadataBuilder, mixed: AttentionMetadataBuilder) -> None:
        super().__init__(decode.backend, decode.spec, decode.group)
        self.decode, self.mixed = decode, mixed

    def build(self, meta: AttentionMetadata) -> Any:
        return (self.decode if decode_step(meta) else self.mixed).build(meta)

    def prepare_cudagraphs(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        for b in (self.decode, self.mixed):
            b.prepare_cudagraphs(max_num_reqs, max_blocks_per_req)


class PerPhaseImpl(AttentionImpl):
    """Both halves' impls of one layer; a step runs its phase's, on the backend_data its builder made."""

    def __init__(self, decode: AttentionImpl, mixed: AttentionImpl) -> None:
        super().__init__(decode.backend, decode.spec, decode.layer)
        self.decode, self.mixed = decode, mixed

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return (self.decode if decode_step(meta) else self.mixed).forward(q, k, v, kv_cache, meta)


class PerPhaseBackend(AttentionBackend):
    """`decode` serves decode steps, `mixed` every other step (decode_step), over one shared KV cache: a
    composition of two backends, named "decode+mixed", that declares what both serve."""

    name = "decode+mixed"  # set per instance
    device_types = ()
    dtypes = ()

    def __init__(self, decode: AttentionBackend, mixed: AttentionBackend) -> None:
        self.decode, self.mixed = decode, mixed
        self.name = f"{decode.name}{SEPARATOR}{mixed.name}"
        self.priority = min(decode.priority, mixed.priority)
        self.device_types = tuple(d for d in decode.device_types if d in mixed.device_types)
        self.dtypes = tuple(d for d in decode.dtypes if d in mixed.dtypes)
        self.block_size_multiple = math.lcm(decode.block_size_multiple, mixed.block_size_multiple)
        # block_size_phase: whose preference the block size is ("decode", "mixed"; None: neither)
        self.preferred_block_size, self.block_size_phase = pair_block_size(decode, mixed)
        self.cudagraph_support = phase_support(decode.cudagraph_support)
        self.attention_features = frozenset(decode.attention_features) & frozenset(mixed.attention_features)
        self.kv_cache_dtypes = tuple(d for d in decode.kv_cache_dtypes if d in mixed.kv_cache_dtypes)
        self.kv_cache_specs = tuple(s for s in decode.kv_cache_specs if s in mixed.kv_cache_specs)

    def halves(self) -> tuple[tuple[str, AttentionBackend], ...]:
        """(phase, backend) of both halves: ("decode", decode), ("mixed", mixed)."""
        return ("decode", self.decode), ("mixed", self.mixed)

    def check(self, ctx: AttentionContext) -> list[str]:
        """Both halves' reasons, each named by its phase, and whether they can share one KV cache."""
        if self.decode.name == self.mixed.name:
            return [f"both phases name {self.decode.name}; name it alone"]
        reasons = [f"{phase} {b.name}: {r}" for phase, b in self.halves() for r in b.check(ctx)]
        return reasons or self.layout_reasons(ctx)

    def layout_reasons(self, ctx: AttentionContext) -> list[str]:
        """Why the halves cannot share one KV cache: a different layout, or no common block size."""
        block = ctx.block_size or self.preferred_block_size
        if block % self.block_size_multiple:
            return []  # the base check reports the block size
        shapes = [
            b.kv_cache_shape(3, block, ctx.num_kv_heads, ctx.head_size, ctx.kv_lora_rank)
            for _, b in self.halves()
        ]
        if shapes[0] != shapes[1]:
            return [
                f"KV-cache layouts differ: {self.decode.name} {tuple(shapes[0])}, "
                f"{self.mixed.name} {tuple(shapes[1])} (for 3 blocks)"
            ]
        return []

    def import_error(self) -> str | None:
        return self.decode.import_error() or self.mixed.import_error()

    def kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        kv_lora_rank: int | None = None,
    ) -> tuple:
        return self.decode.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, kv_lora_rank)

    def make_builder(self, spec: AttentionSpec, group: int = 0) -> PerPhaseBuilder:
        return PerPhaseBuilder(self.decode.make_builder(spec, group), self.mixed.make_builder(spec, group))

    def make_impl(self, spec: AttentionSpec, layer: AttentionLayerSpec) -> PerPhaseImpl:
        return PerPhaseImpl(self.decode.make_impl(spec, layer), self.mixed.make_impl(spec, layer))
