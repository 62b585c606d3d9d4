"""AsyncLLM: the engine behind `turnout serve`. An asyncio front adds, streams and aborts requests while
the engine core (turnout.engine.core) steps in a process of its own, or in a thread where
TURNOUT_ENABLE_MULTIPROCESSING=0 (turnout.engine.core_client). The front keeps each request's stream and
timing; it hears from the core only through CoreBatches, delivered on its event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnout import envs
from turnout.config import EngineConfig
from turnout.engine.core_client import CoreProcClient, CoreThreadClient
from turnout.engine.llm_engine import load_tokenizer, require_tokenizer
from turnout.engine.messages import (
    CoreBatch,
    EngineDeadError,
    EngineOutput,
    EngineRequest,
    EngineShutdownError,
    SchedulerStats,
)
from turnout.errors import TurnoutError

logger = logging.getLogger("turnout")


@dataclass
class IterationStats:
    """What one core batch did, timed on the core's clock; the front fills it from the outputs."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[tuple[str, float, float | None]] = field(default_factory=list)  # reason, e2e, TPOT
    num_failed: int = 0  # requests the engine ended with an error (it died, or the drain's deadline passed)


class StatLogger(Protocol):
    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats) -> None: ...


@dataclass
class _Timing:
    sink: OutputStream
    arrival: float
    prompt_len: int
    first: float | None = None
    last: float = 0.0
    num_tokens: int = 0


class OutputStream:
    """The outputs of one group of requests (a prompt's n samples, or several prompts), in arrival order.

    Iterate it with `async for` (lists of outputs); close() aborts the requests that have not finished
    (their KV blocks are free before the core's next step). per_token=False wakes the reader only when a
    request finishes."""

    def __init__(self, llm: AsyncLLM, req_ids: Sequence[str], per_token: bool) -> None:
        self.llm, self.per_token = llm, per_token
        self.left = set(req_ids)
        self.items: deque[EngineOutput] = deque()
        self.error: TurnoutError | None = None
        self.ready = asyncio.Event()

    def put(self, o: EngineOutput) -> None:
        self.items.append(o)
        if self.per_token or o.finish_reason:
            self.ready.set()

    def fail(self, err: TurnoutError) -> None:
        self.error = err
        self.ready.set()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> list[EngineOutput]:
        """Every output that arrived since the last call, at least one: a reader that falls behind
        catches up in fewer, larger pieces."""
        while not self.items:
            if self.error is not None:
                self.left.clear()
                raise self.error
            if not self.left:
                raise StopAsyncIteration
            self.ready.clear()
            await self.ready.wait()
        batch = list(self.items)
        self.items.clear()
        for o in batch:
            if o.finish_reason:
                self.left.discard(o.req_id)
        return batch

    def close(self) -> None:
        self.llm.abort(list(self.left))
        self.left.clear()

    def __enter__(self) -> OutputStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLLM:
    """AsyncLLM(config): start the engine core now (in a process, or a thread with
    multiprocessing=False); start() on the event loop that will serve it."""

    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int = 1024,
        stat_loggers: Sequence[StatLogger] = (),
        multiprocessing: bool | None = None,  # None: TURNOUT_ENABLE_MULTIPROCESSING
    ) -> None:
        if multiprocessing is None:
            multiprocessing = envs.ENABLE_MULTIPROCESSING.value
        client = CoreProcClient if multiprocessing else CoreThreadClient
        self.client: CoreProcClient | CoreThreadClient = client(config, max_waiting_requests)
        self.config, self.info = config, self.client.info
        self.max_model_len = self.info.max_model_len
        # the front's own tokenizer (the core detokenizes on its side); none where the core has none
        self.tokenizer: Any = None
        self.tokenizer_problem = self.info.tokenizer_problem
        if not self.tokenizer_problem:
            try:
                self.tokenizer, self.tokenizer_problem = load_tokenizer(config, self.info.model)
            except BaseException:
                self.client.shutdown()  # the core is up: a front that fails must not leave it running
                raise
        self.stat_loggers = list(stat_loggers)
        self._timings: dict[str, _Timing] = {}
        self._acks: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = SchedulerStats()  # the core's last
        self.draining = False  # begin_shutdown was called: new requests are refused

    def need_tokenizer(self, what: str) -> Any:
        """The front's tokenizer, or RequestError: `what` needs one, why this engine has none, and the fix."""
        return require_tokenizer(self.tokenizer, self.tokenizer_problem, what)

    @property
    def dead(self) -> str | None:
        return self.client.dead

    @property
    def core_location(self) -> str:
        """Where the engine core steps: "process (pid N)" or "thread"."""
        proc = getattr(self.client, "proc", None)
        return f"process (pid {proc.pid})" if proc is not None else "thread"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.start(self._deliver)

    async def generate(self, reqs: Sequence[EngineRequest], per_token: bool = True) -> OutputStream:
        """Queue the requests, all or none; raises the core's rejection (RequestError, EngineBusyError,
        EngineDeadError) before any runs."""
        assert self._loop is not None, "AsyncLLM.start() first"
        if self.client.dead:
            raise EngineDeadError(self.client.dead)
        if self.draining:
            raise EngineShutdownError("the server is shutting down; retry elsewhere")
        sink = OutputStream(self, [r.req_id for r in reqs], per_token)
        fut = self._loop.create_future()
        key = next(self._keys)
        now = time.monotonic()
        self._acks[key] = fut
        for r in reqs:
            self._timings[r.req_id] = _Timing(sink, now, len(r.prompt_token_ids))
        try:
            self.client.add(reqs, key)
        except EngineDeadError:
            del self._acks[key]
            for r in reqs:
                self._timings.pop(r.req_id, None)
            raise
        try:
            await fut
        except BaseException:
            sink.close()  # cancelled while queued: the abort follows the add to the core
            raise
        return sink

    def abort(self, req_ids: Sequence[str]) -> None:
        live = [i for i in req_ids if self._timings.pop(i, None) is not None]
        if live:
            self.client.abort(live)

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new requests; end those still running after `grace` seconds with an error.
        Safe in a signal handler."""
        self.draining = True
        self.client.drain(time.monotonic() + grace)

    @property
    def drained(self) -> bool:
        """Draining, and no request is left: each has finished or ended with an error (so has each of a
        dead core)."""
        return self.draining and (not (self._timings or self._acks) or self.client.dead is not None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core and its workers; safe to call any number of times."""
        self.client.shutdown(timeout)

    # ---- the front's side of a CoreBatch (on the event loop) ----
    def _deliver(self, b: CoreBatch) -> None:
        for key, err in b.acks:
            fut = self._acks.pop(key)
            if fut.done():  # its waiter was cancelled
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
        it = IterationStats()
        for o in b.outputs:
            it.num_generation_tokens += 1
            t = self._timings.get(o.req_id)
            if t is None:  # aborted by the front; the core hears of it before its next step
                continue
            if t.first is None:
                t.first = b.time
                it.num_prompt_tokens += t.prompt_len
                it.time_to_first_tokens.append(b.time - t.arrival)
            else:
                it.inter_token_latencies.append(b.time - t.last)
            t.last = b.time
            t.num_tokens += 1
            if o.finish_reason:
                del self._timings[o.req_id]
                e2e = b.time - t.arrival
                tpot = (b.time - t.first) / (t.num_tokens - 1) if t.num_tokens > 1 else None
                it.finished.append((o.finish_reason, e2e, tpot))
            t.sink.put(o)
        if b.fail is not None:
            it.num_failed = len(self._timings)
            for t in self._timings.values():
                t.sink.fail(b.fail)
            self._timings.clear()
        stats = self._stats = b.stats or self._stats
        if isinstance(b.fail, EngineDeadError):  # adds the core never read: nobody else will answer them
            for fut in self._acks.values():
                if not fut.done():
                    fut.set_exception(b.fail)
            self._acks.clear()
            # a dead engine runs nothing and holds no KV; the counters keep their totals
            stats = dataclasses.replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)
        for sl in self.stat_loggers:
            sl.record(stats, it)
