"""Continuous batching with chunked prefill, as in vLLM V1.

Each step has a token budget. Running requests go first (decodes take 1 token, unfinished prefills
take their next chunk), then waiting requests are admitted while budget, seats and blocks last. When
blocks run out, the newest running request is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed later from its prompt and the tokens it already generated.

Under async scheduling step N+1 is scheduled before step N's sampled tokens reach the host. A request that
samples in step N carries a placeholder for that token (`num_output_placeholders`); if step N+1 runs it,
its input is `placeholder(k)`, k its row among step N's sampling rows, which the model runner replaces on
the device with that row of step N's sampled tokens. A
request whose in-flight token must end it by length is not scheduled again; one that stops on that token
(EOS, a stop token or string) may be in step N+1 already, and `update` drops the token it gets there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from turnout.engine.block_manager import BlockManager
from turnout.engine.request import Request, RequestStatus
from turnout.sampling_params import SamplingParams


def placeholder(row: int) -> int:
    """The input token that stands for the previous step's row-th sampled token (sampling rows in request
    order); token ids are never negative."""
    return -1 - row


@dataclass
class ScheduledRequest:
    """What a worker needs to run one request for one step (picklable, no engine objects)."""

    req_id: str
    token_ids: list[int]  # the tokens to run now
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    # the request's own lists, one per KV-cache group: the scheduler appends to them, replaces them, or (a
    # windowed group) overwrites leading ids with NULL_BLOCK
    block_ids: tuple[list[int], ...]
    sample: bool  # this step reaches the end of the known tokens, so a new token is sampled
    params: SamplingParams
    prompt_token_ids: list[int]  # filled only when params.needs_history
    output_token_ids: list[int]  # the same; may lack tokens still in flight (async scheduling)
    num_output_tokens: int = 0  # tokens generated before the one this step samples, in-flight ones too


@dataclass
class SchedulerOutput:
    """One step, as the scheduler hands it to the executor: the requests that run and, for each, the tokens
    it runs now; and the ids of requests finished since the last step. Picklable, the same for every rank."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # workers drop their per-request state

    @property
    def num_tokens(self) -> int:
        """Tokens this step runs through the model: the sum of every request's token_ids."""
        return sum(len(r.token_ids) for r in self.requests)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_ids: list[str] = []
        self.num_preemptions = 0
        self._num_sample_rows = 0  # sampling rows of the step being scheduled so far

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self._num_sample_rows = 0
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        computing: set[int] = set()  # hashes of the blocks this step computes
        preempted = False
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            ph = req.num_output_placeholders
            if ph and self._ends_by_length(req, ph):
                continue
            n = min(req.num_tokens + ph - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self.bm.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, n, computing))
                budget -= n
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting.popleft()
            # prompt logprobs need every prompt position computed, so such requests skip the prefix cache
            cached = self.bm.find_cached(req, computing) if req.params.prompt_logprobs is None else ()
            num_cached = len(cached[0]) * self.bm.block_size if cached else 0
            if req.params.prompt_logprobs is None and self._shares_computing(req, num_cached, computing):
                deferred.append(req)
                continue
            n = min(req.num_tokens - num_cached, budget)
            if not self.bm.allocate(req, n, cached):
                self.waiting.appendleft(req)
                break
            self.bm.stats.queries += req.num_tokens
            self.bm.stats.hits += num_cached
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._scheduled(req, n, computing))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        out = SchedulerOutput(scheduled, self.finished_ids)
        self.finished_ids = []
        return out

    def _shares_computing(self, req: Request, num_cached: int, computing: set[int]) -> bool:
        """At least half of what req would compute now, this step computes for another request: req waits
        a step, and then finds it cached."""
        bs = self.bm.block_size
        shared = self.bm.num_computing(req, num_cached // bs, computing) * bs
        return shared > 0 and 2 * shared >= req.num_tokens - num_cached

    def _scheduled(self, req: Request, n: int, computing: set[int]) -> ScheduledRequest:
        """The next n tokens of req, which now count as computed (their full blocks join the prefix cache,
        and `computing`); one that samples adds a placeholder."""
        start = req.num_computed_tokens
        tokens = req.token_slice(start, n)
        if len(tokens) < n:  # the one unknown token: sampled by the step in flight
            tokens.append(placeholder(req.sample_row))
        sample = start + n == req.num_tokens + req.num_output_placeholders
        req.num_computed_tokens += n
        computing.update(self.bm.cache_full_blocks(req))
        if sample:
            req.num_output_placeholders += 1
            req.sample_row, self._num_sample_rows = self._num_sample_rows, self._num_sample_rows + 1
        pen = req.params.needs_history
        return ScheduledRequest(
            req.req_id,
            tokens,
            start,
            req.block_ids,
            sample,
            req.params,
            req.prompt_token_ids if pen else [],
            req.output_token_ids if pen else [],
            len(req.output_token_ids) + req.num_output_placeholders - sample,
        )

    def _ends_by_length(self, req: Request, in_flight: int) -> bool:
        """The tokens in flight bring req to max_tokens or max_model_len: no further step may run it."""
        total = len(req.output_token_ids) + in_flight
        return total >= req.params.max_tokens or req.num_tokens + in_flight >= self.max_model_len

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free_request(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], requests: dict[str, Request]
    ) -> list[Request]:
        """Append sampled tokens, cache blocks now full of known tokens, finish requests that hit a stop.
        A request finished meanwhile (a stop string, an abort, a stop on the token of the step before) drops
        its token. Returns the requests that got one."""
        got = []
        for s in out.requests:
            req = requests[s.req_id]
            if req.is_finished:
                continue
            tok = sampled.get(s.req_id)
            if tok is not None:
                req.output_token_ids.append(tok)
                req.num_output_placeholders -= 1
                got.append(req)
            self.bm.cache_full_blocks(req)  # after the append: a launched step may already compute its KV
            if tok is not None and (reason := self._stop_reason(req)):
                self.finish(req, *reason)
        return got

    def _stop_reason(self, req: Request) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason): EOS and stop tokens count only from min_tokens on."""
        tok, p, n = req.output_token_ids[-1], req.params, len(req.output_token_ids)
        if n >= p.min_tokens and not p.ignore_eos and tok in req.eos_token_ids:
            return "stop", None
        if n >= p.min_tokens and tok in p.stop_token_ids:
            return "stop", tok
        if n >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free_request(req)
        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, reason, stop_reason
        self.finished_ids.append(req.req_id)
