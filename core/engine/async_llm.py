"""AsyncLLM: the engine behind `turnout serve`. The engine core (the LLMEngine step loop) runs in a thread
of its own; an asyncio front adds, streams and aborts requests while it runs.

The two sides share no engine state. The front puts commands (add a group of requests, abort, drain,
stop) into one queue that the core drains between steps; the core hands back, once per step, one
CoreBatch of plain data (acks, one EngineOutput per new token, scheduler stats) through
loop.call_soon_threadsafe. So the core never waits on the front, and a process with a socket in place of
the queue and the callback could replace the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import AutoTokenizer

from turnout.config import EngineConfig
from turnout.engine.llm_engine import LLMEngine, resolve_model_dir
from turnout.errors import TurnoutError
from turnout.sampling_params import SamplingParams

logger = logging.getLogger("turnout")
IDLE_CHECK_S = 1.0  # an idle core checks its workers' health this often


class EngineDeadError(TurnoutError):
    """The engine core stopped on an error; every request fails until the server restarts."""


class EngineBusyError(TurnoutError):
    """The waiting queue is full, or the server is shutting down; the request was not run."""


@dataclass
class EngineRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class EngineOutput:
    """One request's news from one step: one new token."""

    req_id: str
    token_id: int
    logprobs: tuple[float, list[tuple[int, float]]] | None  # chosen token's and the top N, when asked
    text: str | None = None  # the engine's text delta where it detokenizes (stop strings), else None
    finish_reason: str | None = None  # "stop" or "length" on a request's last output
    final_text: str | None = None  # the request's whole text, on its last output
    num_cached_tokens: int = 0  # prefix-cache hits, on the last output


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks held by requests
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # since start


@dataclass
class IterationStats:
    """What one core batch did, timed on the core's clock; the front fills it from the outputs."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[tuple[str, float, float | None]] = field(default_factory=list)  # reason, e2e, TPOT


class StatLogger(Protocol):
    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats) -> None: ...


@dataclass
class CoreBatch:
    time: float
    acks: list[tuple[int, TurnoutError | None]]
    outputs: list[EngineOutput]
    stats: SchedulerStats | None
    fail: TurnoutError | None = None  # every request the front holds ends with this error


class EngineCore:
    """The step loop, run by one thread: commands in, CoreBatches out."""

    def __init__(self, engine: Any, max_waiting_requests: int, send: Callable[[CoreBatch], None]) -> None:
        self.engine = engine
        self.engines: list[LLMEngine] = getattr(engine, "engines", [engine])  # data-parallel replicas
        self.max_waiting = max_waiting_requests
        self.send = send
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # orders a command put after `dead` is set against the last drain
        self.dead: str | None = None
        self.live: set[str] = set()
        self.deadline: float | None = None  # draining: refuse new requests, abort the rest after this
        self.acks: list[tuple[int, TurnoutError | None]] = []

    def run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                commands = self._commands(block=not busy)
                if not self._apply(commands):
                    return
                fail = self._drained()
                outputs = self._step() if self.engine.has_unfinished() else []
                if commands or outputs or busy or fail:
                    self.send(CoreBatch(time.monotonic(), self._take_acks(), outputs, self._stats(), fail))
        except BaseException as e:  # noqa: BLE001 - the front must hear of any end of the loop
            self._die(e)

    def _commands(self, block: bool) -> list[tuple]:
        out = []
        if block:
            try:
                out.append(self.commands.get(timeout=self._idle_timeout()))
            except queue.Empty:
                for e in self.engines:
                    e.executor.check_health()
                return out
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    def _idle_timeout(self) -> float:
        left = IDLE_CHECK_S if self.deadline is None else self.deadline - time.monotonic()
        return min(IDLE_CHECK_S, left) if left > 0 else IDLE_CHECK_S

    def _apply(self, commands: list[tuple]) -> bool:
        for cmd in commands:
            if cmd[0] == "add":
                self._add(cmd[1], cmd[2])
            elif cmd[0] == "abort":
                for req_id in cmd[1]:
                    if req_id in self.live:
                        self.live.discard(req_id)
                        self.engine.abort_request(req_id)
            elif cmd[0] == "drain":
                self.deadline = cmd[1]
            elif cmd[0] == "stop":
                self._close("the server shut down", EngineBusyError)
                return False
        return True

    def _add(self, reqs: list[EngineRequest], key: int) -> None:
        waiting = sum(len(e.scheduler.waiting) for e in self.engines)
        if self.deadline is not None:
            return self.acks.append((key, EngineBusyError("the server is shutting down; retry elsewhere")))
        if waiting + len(reqs) > self.max_waiting:
            msg = (
                f"the waiting queue is full ({waiting} requests, max_waiting_requests {self.max_waiting}); "
                "retry later"
            )
            return self.acks.append((key, EngineBusyError(msg)))
        added: list[str] = []
        try:
            for r in reqs:
                self.engine.add_request(r.prompt_token_ids, r.params, r.req_id)
                added.append(r.req_id)
        except (TurnoutError, ValueError) as e:
            for req_id in added:
                self.engine.abort_request(req_id)
            return self.acks.append((key, e if isinstance(e, TurnoutError) else TurnoutError(str(e))))
        self.live.update(added)
        self.acks.append((key, None))

    def _drained(self) -> TurnoutError | None:
        """Past the drain deadline: abort what is left, and tell the front why."""
        if self.deadline is None or time.monotonic() < self.deadline or not self.live:
            return None
        for req_id in self.live:
            self.engine.abort_request(req_id)
        self.live.clear()
        return EngineBusyError("the server shut down before the request finished; retry elsewhere")

    def _step(self) -> list[EngineOutput]:
        outputs = []
        for s in self.engine.step():
            req = s.req
            lp = None
            if req.params.logprobs is not None:
                logprob, _rank, top = req.logprobs[-1]
                lp = (logprob, top)
            o = EngineOutput(req.req_id, req.output_token_ids[-1], lp, s.delta if req.params.stop else None)
            if s.finished:
                _, o.final_text = self.engine.pop_finished(req.req_id)
                o.finish_reason, o.num_cached_tokens = req.finish_reason, req.num_cached_tokens
                self.live.discard(req.req_id)
            outputs.append(o)
        return outputs

    def _stats(self) -> SchedulerStats:
        s = SchedulerStats()
        free = total = 0
        for e in self.engines:
            sched, bm = e.scheduler, e.scheduler.bm
            s.num_running += len(sched.running)
            s.num_waiting += len(sched.waiting)
            s.prefix_cache_queries += bm.stats.queries
            s.prefix_cache_hits += bm.stats.hits
            s.num_preemptions += sched.num_preemptions
            free, total = free + bm.num_free_blocks, total + bm.num_blocks
        s.kv_cache_usage = 1 - free / total if total else 0.0
        return s

    def _take_acks(self) -> list[tuple[int, TurnoutError | None]]:
        acks, self.acks = self.acks, []
        return acks

    def _die(self, e: BaseException) -> None:
        if isinstance(e, TurnoutError):
            logger.error("engine core stopped: %s", e)
        else:
            logger.exception("engine core stopped")
        self._close(f"the engine stopped ({e}); restart the server", EngineDeadError)
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - already failing; the first error is the one reported
            logger.exception("engine shutdown after a failure")

    def _close(self, why: str, kind: type[TurnoutError]) -> None:
        """The last batch: every request, queued or running, ends with this error; nothing is taken after."""
        err = kind(why)
        with self.lock:
            self.dead = why
        for cmd in self._commands(block=False):
            if cmd[0] == "add":
                self.acks.append((cmd[2], err))
        for req_id in self.live:
            try:
                self.engine.abort_request(req_id)
            except Exception:  # noqa: BLE001 - a dead engine may not abort; its blocks go with it
                break
        self.live.clear()
        self.send(CoreBatch(time.monotonic(), self._take_acks(), [], None, err))


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
    """AsyncLLM(config): load the engine now; start() on the event loop that will serve it."""

    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int = 1024,
        stat_loggers: Sequence[StatLogger] = (),
    ) -> None:
        if config.data_parallel_size > 1:
            from turnout.engine.dp import DataParallelEngine

            engine: Any = DataParallelEngine(config)
        else:
            engine = LLMEngine(config)
        self.config, self.selection = config, engine.selection
        self.max_model_len: int = engine.max_model_len
        # the front's own tokenizer: the core's detokenizes on its thread
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or resolve_model_dir(config))
        self.stat_loggers = list(stat_loggers)
        self.core = EngineCore(engine, max_waiting_requests, self._send)
        self._timings: dict[str, _Timing] = {}
        self._acks: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def dead(self) -> str | None:
        return self.core.dead

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self.core.run, name="turnout-engine-core", daemon=True)
        self._thread.start()

    async def generate(self, reqs: Sequence[EngineRequest], per_token: bool = True) -> OutputStream:
        """Queue the requests, all or none; raises the core's rejection (RequestError, EngineBusyError,
        EngineDeadError) before any runs."""
        assert self._loop is not None, "AsyncLLM.start() first"
        sink = OutputStream(self, [r.req_id for r in reqs], per_token)
        fut = self._loop.create_future()
        key = next(self._keys)
        now = time.monotonic()
        with self.core.lock:
            if self.core.dead:
                raise EngineDeadError(self.core.dead)
            self._acks[key] = fut
            for r in reqs:
                self._timings[r.req_id] = _Timing(sink, now, len(r.prompt_token_ids))
            self.core.commands.put(("add", list(reqs), key))
        try:
            await fut
        except BaseException:
            sink.close()  # cancelled while queued: the abort follows the add in the core's queue
            raise
        return sink

    def abort(self, req_ids: Sequence[str]) -> None:
        live = [i for i in req_ids if self._timings.pop(i, None) is not None]
        if live:
            self.core.commands.put(("abort", live))

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new requests; end those still running after `grace` seconds with an error.
        Safe in a signal handler (SimpleQueue.put is reentrant)."""
        self.core.commands.put(("drain", time.monotonic() + grace))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core and its workers; safe to call any number of times."""
        if self._thread is not None and self._thread.is_alive():
            self.core.commands.put(("stop",))
            self._thread.join(timeout)
        self.core.engine.shutdown()

    # ---- the front's side of a CoreBatch (on the event loop) ----
    def _send(self, batch: CoreBatch) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop closed: nobody is left to hear
            pass

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
            for t in self._timings.values():
                t.sink.fail(b.fail)
            self._timings.clear()
        for sl in self.stat_loggers:
            sl.record(b.stats, it)
