"""What a step hands back: its sampled tokens on the host (`ModelRunnerOutput`), or on their way there
(`AsyncModelRunnerOutput`). The executor contract names both, so they depend on no selection or model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from turnout.engine.request import TokenLogprobs
from turnout.engine.scheduler import ScheduledRequest
from turnout.worker.sampler import SampledTensors


@dataclass
class ModelRunnerOutput:
    """One step's sampled tokens on the host, by request id: the new token of every request that sampled,
    its logprobs where asked (logprob, rank, top N), and the prompt logprobs scored this step."""

    sampled: dict[str, int] = field(default_factory=dict)  # req id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # req id -> (index of the first prompt token scored this step, one entry per prompt token from there)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class AsyncModelRunnerOutput:
    """A step's sampled tokens on their way to the host: the copy is queued behind the step's kernels, and
    get() waits for that copy alone, so the engine prepares the next step meanwhile. token_ids: the sampled
    tokens on the device, which the next step's placeholder inputs take."""

    def __init__(
        self,
        sampled: SampledTensors | None = None,
        reqs: list[ScheduledRequest] = (),
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> None:
        self.reqs, self.prompt_logprobs = reqs, prompt_logprobs or {}
        self.token_ids = sampled.token_ids if sampled is not None else None
        self.sampled = sampled.to_cpu() if sampled is not None else None
        self.copied: torch.cuda.Event | None = None
        if sampled is not None and sampled.token_ids.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def get(self) -> ModelRunnerOutput:
        """Wait for the copy to the host (not for later work on the device); the step's ModelRunnerOutput."""
        if self.sampled is None:
            return ModelRunnerOutput(prompt_logprobs=self.prompt_logprobs)
        if self.copied is not None:
            self.copied.synchronize()
        res = self.sampled.host()
        out = ModelRunnerOutput(
            {r.req_id: t for r, t in zip(self.reqs, res.token_ids)}, {}, self.prompt_logprobs
        )
        if res.logprobs is not None and res.ranks is not None and res.top_logprobs is not None:
            for r, lp, rank, top in zip(self.reqs, res.logprobs, res.ranks, res.top_logprobs):
                if r.params.logprobs is not None:
                    out.logprobs[r.req_id] = (lp, rank, top)
        return out
