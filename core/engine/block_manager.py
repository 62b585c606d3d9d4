"""Paged KV-cache blocks with prefix caching.

A full block is keyed by a chained hash: hash(parent block's hash, its token ids), so equal keys mean
equal prefixes. Blocks carry reference counts; a block whose count drops to 0 keeps its hash and waits
in the free queue (LRU: least recently freed is reused first), so a later request with the same prefix
can take it back until it is evicted by reuse.

A block is registered as soon as the step that computes it is scheduled: steps run on the device in the
order they are launched, so every later step reads it whole, even one scheduled before that step ends
(async scheduling). The step that computes it does not: its hash is in that step's `computing` set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from turnout.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hashes: dict[str, list[int]] = {}  # req id -> hashes of its full blocks, in order
        self.registered: dict[str, int] = {}  # req id -> how many of its first blocks cache_full_blocks saw

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, req: Request, upto: int) -> list[int]:
        """Chained hashes of the request's full blocks among its first `upto` tokens (memoised)."""
        hashes = self.hashes.setdefault(req.req_id, [])
        bs = self.block_size
        for i in range(len(hashes), upto // bs):  # each step adds at most one block: no copy of the history
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(req.token_slice(i * bs, bs)))))
        return hashes

    def find_cached(self, req: Request, computing: Container[int] = ()) -> list[int]:
        """Block ids of the longest prefix cached by earlier steps (not in `computing`, the blocks the step
        being scheduled computes), leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for h in self._block_hashes(req, req.num_tokens - 1):
            block_id = self.cached.get(h)
            if block_id is None or h in computing:
                break
            found.append(block_id)
        return found

    def num_computing(self, req: Request, start: int, computing: Container[int]) -> int:
        """How many of req's full blocks, from block `start` on, the step being scheduled computes for
        other requests (after find_cached, which hashed the prompt)."""
        n = 0
        for h in self.hashes.get(req.req_id, [])[start:]:
            if h not in computing:
                break
            n += 1
        return n

    def can_allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        have = len(req.block_ids) + len(cached)
        need = self.blocks_needed(self._end(req, num_new_tokens, cached)) - have
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # taken from the free queue
        return need <= self.num_free_blocks - revived

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give req the cached blocks and enough new ones for num_new_tokens more; False if they don't fit."""
        if not cached and req.num_computed_tokens + num_new_tokens <= len(req.block_ids) * self.block_size:
            return True  # most decode steps: the last block has room
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        for b in cached:
            self._ref(b)
        req.block_ids.extend(cached)
        need = self.blocks_needed(self._end(req, num_new_tokens, cached)) - len(req.block_ids)
        req.block_ids.extend(self._take() for _ in range(need))
        return True

    def _end(self, req: Request, num_new_tokens: int, cached: Sequence[int]) -> int:
        """Tokens the request will hold: computed (or about to be, from the cache) plus the new ones."""
        return req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict the least recently freed cached block
        block.hash, block.ref_count = None, 1
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
        for block_id, h in zip(req.block_ids[start:], hashes[start:]):
            block = self.blocks[block_id]
            if block.hash is None:
                block.hash = h
                if self.cached.setdefault(h, block_id) == block_id:  # else an earlier block holds it
                    new.append(h)
        self.registered[req.req_id] = min(full, len(req.block_ids))
        return new

    def free_request(self, req: Request) -> None:
        # tail blocks first, so a prefix's first blocks are the last to be evicted
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        req.block_ids = []
        self.hashes.pop(req.req_id, None)
        self.registered.pop(req.req_id, None)
