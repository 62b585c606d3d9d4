"""A request as the scheduler sees it: tokens, progress, blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from turnout.sampling_params import SamplingParams

TokenLogprobs = tuple[float, int, list[tuple[int, float]]]  # a token's logprob, its rank, the top N


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
    block_ids: tuple[list[int], ...] = field(default_factory=lambda: ([],))  # one list per KV-cache group
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    num_preemptions: int = 0
    # per generated token (logprobs) / prompt token after the first (prompt_logprobs), when asked:
    # (the token's logprob, its rank, the top N as (token id, logprob))
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
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
    def cumulative_logprob(self) -> float:
        return sum(lp for lp, _, _ in self.logprobs)

    @property
    def hides_stop_token(self) -> bool:
        """Ended by EOS or a stop token id: that token stays in output_token_ids but not in the text."""
        stopped_by_token = self.finish_reason == "stop" and not isinstance(self.stop_reason, str)
        return stopped_by_token and not self.params.include_stop_str_in_output

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
