"""A request as the scheduler sees it: tokens, progress, blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from turnout.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is an entity: `in` and remove() compare identity, not 15 fields
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache, or is computed by a step already launched
    num_output_placeholders: int = 0  # tokens sampled by launched steps, not yet appended to output_token_ids
    sample_row: int = 0  # its row among the sampling rows of the last step that sampled for it
    num_cached_tokens: int = 0  # of those, prefix-cache hits at (re)admission
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    num_preemptions: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stream: bool = False  # its text is wanted token by token (LLM.stream), not only at the end

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, n: int) -> list[int]:
        """(prompt + output)[start:start + n] without copying the whole history (a decode step wants 1)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        return self.prompt_token_ids[start : start + n] + self.output_token_ids[: max(0, start + n - p)]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
