"""KV-cache specs and groups, in vLLM's vocabulary.

A KVCacheSpec says what one attention layer keeps per token (a key and a value, or multi-head latent
attention's one latent vector) and how many of a request's blocks it must hold: full attention and MLA keep
them all, a sliding window only those its latest queries can still see. Layers
with equal specs form KV-cache groups; every group has its own block table per request, and all groups
draw their block ids from one pool. KV memory is shared slot-wise: group g's j-th layer and group h's j-th
layer use the same tensor, each through the block ids its own group holds, so a block id costs
`group_size` layer pages, whatever group takes it. Groups therefore have at most `group_size` layers; a
spec with more layers than that forms several groups.

Blocks a windowed group no longer needs go back to the pool, and the request's table shows NULL_BLOCK in
their place, so tables stay rectangular. NULL_BLOCK is never handed out where a group frees blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

NULL_BLOCK = 0  # stands for a block freed out of a window; never allocated where a group frees blocks
KV_CACHE_SPEC_KINDS = ("full", "sliding_window", "mla")  # what a backend may declare in kv_cache_specs


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV cache. A subclass sets `kind` and may change what a token takes (a latent cache
    stores one vector instead of a key and a value) and which blocks a request must keep."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype  # the cache's element dtype
    kind: ClassVar[str] = ""

    @property
    def bytes_per_token(self) -> int:
        """What one token takes in one layer: a key and a value of num_kv_heads x head_size."""
        return 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """What one block takes in one layer."""
        return self.block_size * self.bytes_per_token

    @property
    def frees_blocks(self) -> bool:
        """Whether a request's early blocks go back to the pool while it runs."""
        return False

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from position num_computed_tokens on reads (they can be freed)."""
        return 0

    def max_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, computed in chunks of at most
        max_num_batched_tokens tokens."""
        return cdiv(num_tokens, self.block_size)

    def describe(self) -> str:
        """The spec in a few words, as `turnout explain` prints it."""
        return self.kind


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every query attends to every earlier token: a request keeps all of its blocks."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A query at position p attends to (p - sliding_window, p]: blocks wholly before the window of the next
    query are freed."""

    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    @property
    def frees_blocks(self) -> bool:
        return True

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def max_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        # a chunk's first query still needs the window before it; one more block where they straddle
        keep = min(num_tokens, self.sliding_window - 1 + max_num_batched_tokens)
        return min(cdiv(num_tokens, self.block_size), cdiv(keep, self.block_size) + 1)

    def describe(self) -> str:
        return f"sliding_window {self.sliding_window}"


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention's cache: one vector of head_size = kv_lora_rank + qk_rope_head_dim a
    token (num_kv_heads 1), the key of every query head; the values are its first kv_lora_rank dims. Every
    query attends to every earlier token, as under FullAttentionSpec."""

    kv_lora_rank: int
    kind: ClassVar[str] = "mla"

    @property
    def bytes_per_token(self) -> int:
        """One latent vector: no separate key and value."""
        return self.num_kv_heads * self.head_size * self.dtype.itemsize

    def describe(self) -> str:
        return f"mla {self.kv_lora_rank}+{self.head_size - self.kv_lora_rank}"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one spec that share a block table: layer_ids are attention layer indices over the whole
    model (all pipeline stages, in order); layer_ids[j] uses the KV tensor of slot j."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV-cache groups of a model and how its layers map to KV tensors. group_size: the layers of the
    largest group, the slots (tensors) a block id spans. stage_layers: the attention layers of each
    pipeline stage, whose layer indices start at the sum of the stages' before it."""

    groups: tuple[KVCacheGroup, ...]
    group_size: int
    stage_layers: tuple[int, ...]

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        """Each group's spec, in group order."""
        return tuple(g.spec for g in self.groups)

    @property
    def uses_null_block(self) -> bool:
        """Some group frees blocks, so NULL_BLOCK is kept out of the pool."""
        return any(g.spec.frees_blocks for g in self.groups)

    def placement(self, stage: int) -> list[tuple[int, int]]:
        """(group, KV tensor slot) of each attention layer of pipeline stage `stage`, by its local index."""
        start = sum(self.stage_layers[:stage])
        where = {i: (g, j) for g, group in enumerate(self.groups) for j, i in enumerate(group.layer_ids)}
        return [where[start + i] for i in range(self.stage_layers[stage])]

    def blocks_for_tokens(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Blocks of the pool one request of num_tokens tokens holds at most, over every group, computed in
        chunks of max_num_batched_tokens (None: decode, one token a step)."""
        chunk = 1 if max_num_batched_tokens is None else max_num_batched_tokens
        return sum(g.spec.max_blocks(num_tokens, chunk) for g in self.groups)

    def usable_blocks(self, num_blocks: int) -> int:
        """The pool blocks requests can hold: all num_blocks but NULL_BLOCK where it is kept out."""
        return num_blocks - self.uses_null_block

    def max_tokens(self, num_blocks: int, max_num_batched_tokens: int) -> int:
        """The longest request that num_blocks pool blocks hold."""
        usable = self.usable_blocks(num_blocks)
        lo, hi = 0, usable * self.groups[0].spec.block_size
        while lo < hi:  # the largest n with blocks_for_tokens(n) <= usable
            mid = (lo + hi + 1) // 2
            lo, hi = (
                (mid, hi) if self.blocks_for_tokens(mid, max_num_batched_tokens) <= usable else (lo, mid - 1)
            )
        return lo

    def max_concurrency(self, num_blocks: int, num_tokens: int, max_num_batched_tokens: int) -> float:
        """How many requests of num_tokens tokens num_blocks pool blocks hold at once (vLLM's "maximum
        concurrency"): the usable blocks over the blocks one such request holds at most."""
        return self.usable_blocks(num_blocks) / self.blocks_for_tokens(num_tokens, max_num_batched_tokens)

    def describe(self) -> list[str]:
        """One line a group: its spec and how many layers it has."""
        return [
            f"group {i}: {g.spec.describe()}, {len(g.layer_ids)} layers" for i, g in enumerate(self.groups)
        ]


def kv_cache_config(stage_specs: Sequence[Sequence[KVCacheSpec]]) -> KVCacheConfig:
    """Group the layers of every pipeline stage (stage_specs[s][i]: stage s's layer i) by spec. One spec:
    one group of every layer. Otherwise group_size is the fewest layers a spec has, and each spec's
    layers, in order, form groups of at most that many (so every block id spans group_size tensors)."""
    specs = [s for stage in stage_specs for s in stage]
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, s in enumerate(specs):
        by_spec.setdefault(s, []).append(i)
    if len({s.page_size_bytes for s in by_spec}) > 1:
        pages = ", ".join(f"{s.describe()} {s.page_size_bytes} bytes" for s in by_spec)
        raise ValueError(f"KV-cache specs of different page sizes cannot share one block pool: {pages}")
    size = min(map(len, by_spec.values()))
    groups = tuple(
        KVCacheGroup(spec, tuple(ids[k : k + size]))
        for spec, ids in by_spec.items()
        for k in range(0, len(ids), size)
    )
    return KVCacheConfig(groups, size, tuple(map(len, stage_specs)))
