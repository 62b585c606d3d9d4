"""Batch -> (runtime mode, padded token count).

A batch is uniform decode when every request runs exactly one token. Its token count is padded up to
the next capture size; the padded rows get slot_mapping -1 so they write no KV. Batches larger than the
largest capture size run eager.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from turnout.graphs.modes import GraphPolicy, RuntimeMode

MAX_CAPTURE_SIZE = 512  # vLLM's largest default capture size
WIDE_STEP = 64  # capture sizes past MAX_CAPTURE_SIZE: multiples of this up to max_num_seqs


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's defaults: 1, 2, 4, then multiples of 8 below 256, then multiples of 16 up to
    min(2 * max_num_seqs, MAX_CAPTURE_SIZE). Past that, multiples of WIDE_STEP up to the first that covers
    max_num_seqs, so that every decode step replays a graph: an eager step of 1024 requests is bound by its
    kernel launches on the host."""
    top = min(2 * max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    wide = range(MAX_CAPTURE_SIZE + WIDE_STEP, max_num_seqs + WIDE_STEP, WIDE_STEP)
    return [s for s in sizes if s <= top] + list(wide)


@dataclass(frozen=True)
class Dispatch:
    mode: RuntimeMode
    num_tokens: int  # after padding
    uniform_decode: bool


class GraphDispatcher:
    def __init__(self, policy: GraphPolicy, capture_sizes: list[int]) -> None:
        self.policy = policy
        self.capture_sizes = sorted(set(capture_sizes))

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def dispatch(self, query_lens: list[int]) -> Dispatch:
        num_tokens = sum(query_lens)
        uniform = all(q == 1 for q in query_lens)
        mode = self.policy.runtime_mode(num_tokens, uniform)
        padded = self.padded_size(num_tokens)
        if mode is RuntimeMode.NONE or padded is None:
            return Dispatch(RuntimeMode.NONE, num_tokens, uniform)
        return Dispatch(mode, padded, uniform)
