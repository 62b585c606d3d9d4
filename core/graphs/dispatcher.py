"""Batch -> (runtime mode, padded token count).

A batch is uniform decode when every request runs exactly one token. Its token count is padded up to
the next capture size; the padded rows get slot_mapping -1 so they write no KV. Batches larger than the
largest capture size run eager, and so do mixed batches above mixed_max: the sizes past it are captured
for uniform decode only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from turnout.graphs.modes import GraphPolicy, RuntimeMode

MIXED_MAX = 512  # vLLM's largest default capture size
DECODE_STEP = 32  # uniform-decode sizes past MIXED_MAX: at most 31 padded rows in 544 or more


def default_capture_sizes(max_num_seqs: int) -> tuple[list[int], int]:
    """vLLM's defaults, 1, 2, 4, then multiples of 8 below 256, then multiples of 16 up to
    min(2 * max_num_seqs, 512), for both modes; then, for uniform decode alone, multiples of 32 up to
    max_num_seqs (a decode step runs one token a request; at hundreds of requests an eager step's launches
    cost more than its kernels). Returns (sizes, mixed_max), the largest size mixed batches use."""
    top = min(2 * max_num_seqs, MIXED_MAX)
    sizes = [s for s in (1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)) if s <= top]
    return sizes + list(range(top + DECODE_STEP, max_num_seqs + 1, DECODE_STEP)), top


@dataclass(frozen=True)
class Dispatch:
    mode: RuntimeMode
    num_tokens: int  # after padding
    uniform_decode: bool


class GraphDispatcher:
    def __init__(self, policy: GraphPolicy, capture_sizes: list[int], mixed_max: int | None = None) -> None:
        self.policy = policy
        self.capture_sizes = sorted(set(capture_sizes))
        self.mixed_max = self.capture_sizes[-1] if mixed_max is None else mixed_max

    def modes(self, n: int) -> set[tuple[RuntimeMode, bool]]:
        """The (mode, uniform_decode) pairs a capture size serves: both phases up to mixed_max, past it
        uniform decode alone."""
        return {(self.policy.runtime_mode(n, u), u) for u in (True, False) if u or n <= self.mixed_max}

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def dispatch(self, query_lens: list[int]) -> Dispatch:
        num_tokens = sum(query_lens)
        uniform = all(q == 1 for q in query_lens)
        mode = self.policy.runtime_mode(num_tokens, uniform)
        padded = self.padded_size(num_tokens)
        if mode is RuntimeMode.NONE or padded is None or (not uniform and padded > self.mixed_max):
            return Dispatch(RuntimeMode.NONE, num_tokens, uniform)
        return Dispatch(mode, padded, uniform)
