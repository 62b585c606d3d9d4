"""What generate returns: one RequestOutput per prompt, holding n CompletionOutputs (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float  # under log_softmax of the raw model logits
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per position: token id -> Logprob (the chosen one and the top N)
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; None for the first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when logprobs were asked
    logprobs: SampleLogprobs | None = None


@dataclass
class RequestOutput:
    """One prompt's result (vLLM's shape): the prompt and its token ids, its n CompletionOutputs (one per
    sample, by index), how many prompt tokens came from the prefix cache, and prompt logprobs where asked."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None  # set when this request was rejected; the others still ran
    prompt_logprobs: PromptLogprobs | None = None
    finished: bool = True

    @property
    def text(self) -> str:
        """The first completion's text; "" where there is none."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        """The first completion's generated token ids (not the prompt's); [] where there is none."""
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        """Why the first completion ended ("stop", "length", "abort"); "error" where there is none."""
        return self.outputs[0].finish_reason if self.outputs else "error"
