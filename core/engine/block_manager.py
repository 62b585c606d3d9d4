"""Paged KV-cache blocks with prefix caching.

A full block is keyed by a chained hash: hash(parent block's hash, its token ids), so equal keys mean
equal prefixes. Blocks carry reference counts; a block whose count drops to 0 keeps its hash and waits
in the free queue (LRU: least recently freed is reused first), so a later request with the same prefix
can take it back until it is evicted by reuse.

A block is registered as soon as the step that computes it is scheduled: steps run on the device in the
order they are launched, so every later step reads it whole, even one scheduled before that step ends
(async scheduling). The step that computes it does not: its hash is in that step's `computing` set.

KV-cache groups (turnout.attention.kv_spec): a request holds one list of block ids per group, all taken from
this one pool, each list as long as the others. A group whose spec frees blocks (a sliding window) returns
the blocks wholly before the window of the request's next query to the pool, and NULL_BLOCK takes their
place in its list; they keep their hash, so a later request can take them back. A prefix hit must then hold
every block of the full-attention groups and, of each windowed group, the blocks in the window of the hit's
last token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field

from turnout.attention.kv_spec import NULL_BLOCK, KVCacheSpec, cdiv
from turnout.engine.request import Request

CachedBlocks = tuple[list[int], ...]  # a prefix hit: block ids per group, NULL_BLOCK where a window skips


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    group: int = 0  # the KV-cache group that holds it


class _Blocks(dict):
    """Block by block id, each made when first used: a pool can hold a hundred thousand blocks (a tiny model
    in the CPU's KV bytes), of which a run may use few."""

    def __missing__(self, block_id: int) -> Block:
        block = self[block_id] = Block(block_id)
        return block


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class BlockManager:
    """The pool of num_blocks KV blocks and the block ids of every request, per KV-cache group
    (kv_cache_specs: each group's spec; empty: one full-attention group)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    kv_cache_specs: tuple[KVCacheSpec, ...] = ()
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.num_groups = max(1, len(self.kv_cache_specs))
        self.windowed = [g for g, s in enumerate(self.kv_cache_specs) if s.frees_blocks]
        self.full = [g for g in range(self.num_groups) if g not in self.windowed]
        self.null = NULL_BLOCK if self.windowed else None  # kept out of the pool where a window frees blocks
        first = NULL_BLOCK + 1 if self.windowed else 0
        self.blocks = _Blocks()
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, self.num_blocks))
        self.cached: list[dict[int, int]] = [
            {} for _ in range(self.num_groups)
        ]  # per group: hash -> block id
        self.hashes: dict[str, list[int]] = {}  # req id -> hashes of its full blocks, in order
        self.registered: dict[str, int] = {}  # req id -> how many of its first blocks cache_full_blocks saw
        self.skipped: dict[str, list[int]] = {}  # req id -> leading blocks nulled, per group

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_pool_blocks(self) -> int:
        """The blocks requests can hold: num_blocks, less NULL_BLOCK where a group frees blocks."""
        return self.num_blocks - (self.null is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, req: Request, upto: int) -> list[int]:
        """Chained hashes of the request's full blocks among its first `upto` tokens (memoised)."""
        hashes = self.hashes.setdefault(req.req_id, [])
        bs = self.block_size
        for i in range(len(hashes), upto // bs):  # each step adds at most one block: no copy of the history
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(req.token_slice(i * bs, bs)))))
        return hashes

    def find_cached(self, req: Request, computing: Container[int] = ()) -> CachedBlocks:
        """Block ids, per group, of the longest prefix cached by earlier steps (not in `computing`, the blocks
        the step being scheduled computes), leaving at least one token to compute; () for none. A windowed
        group holds NULL_BLOCK for the blocks before the window of the prefix's last token."""
        if not self.enable_prefix_caching:
            return ()
        hashes = self._block_hashes(req, req.num_tokens - 1)
        n = len(hashes)
        for g in self.full:
            n = next((i for i, h in enumerate(hashes[:n]) if h not in self.cached[g] or h in computing), n)
        while n and not all(self._window_hit(g, hashes, n, computing) for g in self.windowed):
            n -= 1
        if not n:
            return ()
        return tuple(self._hit(g, hashes, n) for g in range(self.num_groups))

    def _window_hit(self, g: int, hashes: list[int], n: int, computing: Container[int]) -> bool:
        """Windowed group g holds every block in the window of token n * block_size (the first to compute)."""
        skip = self.kv_cache_specs[g].num_skipped_blocks(n * self.block_size)
        return all(h in self.cached[g] and h not in computing for h in hashes[skip:n])

    def _hit(self, g: int, hashes: list[int], n: int) -> list[int]:
        skip = self.kv_cache_specs[g].num_skipped_blocks(n * self.block_size) if g in self.windowed else 0
        return [NULL_BLOCK] * skip + [self.cached[g][h] for h in hashes[skip:n]]

    def num_computing(self, req: Request, start: int, computing: Container[int]) -> int:
        """How many of req's full blocks, from block `start` on, the step being scheduled computes for
        other requests (after find_cached, which hashed the prompt)."""
        n = 0
        for h in self.hashes.get(req.req_id, [])[start:]:
            if h not in computing:
                break
            n += 1
        return n

    def can_allocate(self, req: Request, num_new_tokens: int, cached: CachedBlocks = ()) -> bool:
        """Whether the free queue holds the new blocks of every group that allocate would take, the cached
        blocks it revives from that queue counted out."""
        have = len(req.block_ids[0]) + (len(cached[0]) if cached else 0)
        need = self.blocks_needed(self._end(req, num_new_tokens, cached)) - have
        revived = sum(
            1 for ids in cached for b in set(ids) if b != self.null and self.blocks[b].ref_count == 0
        )
        return need * self.num_groups <= self.num_free_blocks - revived

    def allocate(self, req: Request, num_new_tokens: int, cached: CachedBlocks = ()) -> bool:
        """Give req the cached blocks and enough new ones for num_new_tokens more, in every group, after
        freeing what its windows left behind; False if they don't fit."""
        if len(req.block_ids) != self.num_groups:
            req.block_ids = tuple([] for _ in range(self.num_groups))
        if self.windowed:
            self._free_skipped(req)
        if not cached and req.num_computed_tokens + num_new_tokens <= len(req.block_ids[0]) * self.block_size:
            return True  # most decode steps: the last block has room
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        need = self.blocks_needed(self._end(req, num_new_tokens, cached)) - len(req.block_ids[0])
        for g, ids in enumerate(req.block_ids):  # every group's hit leaves the free queue before any _take
            if cached:
                for b in cached[g]:
                    if b != self.null:
                        self._ref(b)
                ids.extend(cached[g])
        for g, ids in enumerate(req.block_ids):
            ids.extend(self._take(g) for _ in range(need - (len(cached[g]) if cached else 0)))
        return True

    def _end(self, req: Request, num_new_tokens: int, cached: CachedBlocks) -> int:
        """Tokens the request will hold: computed (or about to be, from the cache) plus the new ones."""
        return req.num_computed_tokens + (len(cached[0]) if cached else 0) * self.block_size + num_new_tokens

    def _free_skipped(self, req: Request) -> None:
        """Return the blocks of req's windowed groups that no query from its next token on reads."""
        done = self.skipped.setdefault(req.req_id, [0] * self.num_groups)
        for g in self.windowed:
            ids = req.block_ids[g]
            end = min(self.kv_cache_specs[g].num_skipped_blocks(req.num_computed_tokens), len(ids))
            for i in range(done[g], end):
                self._unref(ids[i])
                ids[i] = NULL_BLOCK
            done[g] = max(done[g], end)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        if block_id == self.null:
            return
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def _take(self, group: int = 0) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached[block.group].get(block.hash) == block_id:
            del self.cached[block.group][block.hash]  # evict the least recently freed cached block
        block.hash, block.ref_count, block.group = None, 1, group
        return block_id

    def cache_full_blocks(self, req: Request) -> list[int]:
        """Register the request's blocks now full of known tokens that are computed or in a launched step;
        return the hashes that now lead to its blocks."""
        known = min(req.num_computed_tokens, req.num_tokens)  # a sampled token in flight has no id yet
        full, start = known // self.block_size, self.registered.get(req.req_id, 0)
        if not self.enable_prefix_caching or full <= start:
            return []  # no block filled up since the last call
        # find_cached may have hashed the whole prompt: a chunk that ends inside a block leaves it unhashed
        hashes = self._block_hashes(req, known)[:full]
        new = []
        for g, ids in enumerate(req.block_ids):
            for block_id, h in zip(ids[start:], hashes[start:]):
                block = self.blocks[block_id]
                if block.hash is None and block_id != self.null:
                    block.hash = h
                    if self.cached[g].setdefault(h, block_id) == block_id:  # else an earlier block holds it
                        new.append(h)
        self.registered[req.req_id] = min(full, len(req.block_ids[0]))
        return new

    def free_request(self, req: Request) -> None:
        # tail positions first, every group's block at a position together, so that a prefix's first blocks
        # are the last to be evicted in every group
        for i in reversed(range(len(req.block_ids[0]))):
            for ids in req.block_ids:
                self._unref(ids[i])
        req.block_ids = tuple([] for _ in range(self.num_groups))
        self.hashes.pop(req.req_id, None)
        self.registered.pop(req.req_id, None)
        self.skipped.pop(req.req_id, None)
