"""The block table of a step and the cache slot of every token, built on the host in numpy; BlockTables
keeps a persistent row per request that a worker runs, one BlockTables per KV-cache group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from turnout.attention.kv_spec import NULL_BLOCK

if TYPE_CHECKING:
    from turnout.engine.scheduler import ScheduledRequest


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


def block_table(block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """[B, max_blocks] int32: request i's block ids as row i, padded with 0."""
    table = np.zeros((len(block_ids), max(map(len, block_ids))), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table


def slot_mapping(table: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """[T] int64: the cache slot of token t, which is at positions[t] of request rows[t]."""
    slots = table[rows, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return slots


class BlockTables:
    """The block ids of each request a worker runs, one persistent row each, written incrementally: a step
    copies only the ids a request gained since its last step. ScheduledRequest.block_ids is the scheduler's
    own list for group `group` (ScheduledRequest.block_ids[group]), which it only appends to (a preemption
    replaces it), so the list last seen and the count written tell what is new; a list that came through a
    pipe is new each step and rewrites its row. Where the group's spec frees blocks, the scheduler also
    overwrites the leading ids it freed with NULL_BLOCK: skip(start_pos), the spec's num_skipped_blocks,
    says how many, and the row's leading entries are nulled to match."""

    def __init__(self, group: int = 0, skip: Callable[[int], int] | None = None) -> None:
        self.group, self.skip = group, skip
        self.table = np.zeros((64, 16), dtype=np.int32)
        self.rows: dict[str, tuple[int, list[int], int]] = {}  # req id -> (row, list seen, ids written)
        self.free = list(range(63, -1, -1))

    def __call__(self, reqs: list[ScheduledRequest]) -> np.ndarray:  # [len(reqs), most blocks] int32
        rows, width, g = [], 0, self.group
        for r in reqs:
            ids = r.block_ids[g]
            n = len(ids)
            row, seen, done = self.rows.get(r.req_id) or (self._take(), None, 0)
            if seen is not ids or done != n:
                self._write(row, ids, done if seen is ids else 0)
                self.rows[r.req_id] = (row, ids, n)
            if self.skip is not None:
                self.table[row, : self.skip(r.start_pos)] = NULL_BLOCK
            rows.append(row)
            width = max(width, n)
        return self.table[rows, :width]

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if (entry := self.rows.pop(req_id, None)) is not None:
                self.table[entry[0]] = 0
                self.free.append(entry[0])

    def _take(self) -> int:
        if not self.free:
            n = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    def _write(self, row: int, ids: list[int], start: int) -> None:
        if len(ids) > self.table.shape[1]:
            wider = np.zeros((len(self.table), max(len(ids), 2 * self.table.shape[1])), dtype=np.int32)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        if start == 0:
            self.table[row] = 0
        self.table[row, start : len(ids)] = ids[start:]
