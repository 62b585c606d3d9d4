"""The block table of a step and the cache slot of every token, built on the host in numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
