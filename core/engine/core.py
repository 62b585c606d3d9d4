"""The engine core: the LLMEngine step loop behind `turnout serve`, and its process.

The core shares no engine state with the front (turnout.engine.async_llm). It takes commands (add a group
of requests, abort, drain, stop) from one queue that it drains between steps, and hands back, once per
step, one CoreBatch of plain data (turnout.engine.messages): acks, one EngineOutput per new token,
scheduler stats. So the core never waits on the front. In a thread the queue is a SimpleQueue and the
batch a callback; in a process of its own (run_engine_core) both travel as msgpack over ZeroMQ sockets
(turnout.engine.serial).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from turnout.config import EngineConfig
from turnout.engine.llm_engine import LLMEngine
from turnout.engine.messages import (
    CoreBatch,
    EngineBusyError,
    EngineDeadError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineShutdownError,
    SchedulerStats,
)
from turnout.errors import TurnoutError
from turnout.executor.rank import exit_with_parent

logger = logging.getLogger("turnout")
IDLE_CHECK_S = 1.0  # an idle core checks its workers' health this often


def make_engine(config: EngineConfig) -> Any:
    """An LLMEngine, or data_parallel_size replicas of one behind the same request API. tune = auto is the
    entry points' (LLM, the server), which tune before they make one; the engine only reads records."""
    if config.data_parallel_size > 1:
        from turnout.engine.dp import DataParallelEngine

        return DataParallelEngine(config)
    return LLMEngine(config)


class EngineCore:
    """The step loop, run by one thread: commands in (a SimpleQueue, or anything with its get and
    get_nowait), CoreBatches out."""

    def __init__(
        self,
        engine: Any,
        max_waiting_requests: int,
        send: Callable[[CoreBatch], None],
        commands: Any = None,
    ) -> None:
        self.engine = engine
        self.engines: list[LLMEngine] = getattr(engine, "engines", [engine])  # data-parallel replicas
        self.max_waiting = max_waiting_requests
        self.send = send
        self.commands = queue.SimpleQueue() if commands is None else commands
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
                self._close("the server shut down", EngineShutdownError)
                return False
        return True

    def _add(self, reqs: list[EngineRequest], key: int) -> None:
        waiting = sum(len(e.scheduler.waiting) for e in self.engines)
        if self.deadline is not None:
            refusal = EngineShutdownError("the server is shutting down; retry elsewhere")
            return self.acks.append((key, refusal))
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
        return EngineShutdownError("the server shut down before the request finished; retry elsewhere")

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
            st = e.stats()
            s.num_running += len(e.scheduler.running)
            s.num_waiting += len(e.scheduler.waiting)
            s.prefix_cache_queries += st["prefix_cache_queries"]
            s.prefix_cache_hits += st["prefix_cache_hits"]
            s.num_preemptions += st["preemptions"]
            free, total = free + st["free_blocks"], total + st["total_blocks"]
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


# ---- the engine core in a process of its own ----
def run_engine_core(
    config: EngineConfig, max_waiting_requests: int, input_addr: str, output_addr: str, log_level: int
) -> None:
    """The body of the engine-core process: build the engine, send ("ready", EngineInfo) or ("error",
    the error) on the output socket, then step until told to stop, one CoreBatch message per step."""
    import zmq

    from turnout.engine import serial

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's: it drains, then stops the core
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(log_level)
    exit_with_parent("front")  # the executor's workers watch this process in turn
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, addr in ((inp, input_addr), (out, output_addr)):
        sock.setsockopt(zmq.RCVHWM if sock is inp else zmq.SNDHWM, 0)  # never drop, never block the loop
        sock.connect(addr)
    try:
        try:
            engine = make_engine(config)
        except BaseException as e:  # noqa: BLE001 - the front reports it as one line
            if not isinstance(e, TurnoutError):
                logger.debug("engine core start-up failed", exc_info=True)
            out.send(serial.pack(("error", serial.encode_error(e))))
            return
        out.send(serial.pack(("ready", serial.encode_info(EngineInfo.of(engine)))))
        send = lambda b: out.send(serial.encode_batch(b))  # noqa: E731
        EngineCore(engine, max_waiting_requests, send, SocketQueue(inp)).run()
        engine.shutdown()
    finally:
        inp.close(linger=0)
        out.close(linger=5000)  # the last batch (or the start-up error) still reaches the front
        ctx.term()


class SocketQueue:
    """The core's command queue in its process: a ZeroMQ PULL socket, read as a SimpleQueue is."""

    def __init__(self, sock: Any) -> None:
        from turnout.engine import serial

        self.sock, self.decode = sock, serial.decode_command

    def get(self, timeout: float) -> tuple:
        if not self.sock.poll(timeout * 1000):
            raise queue.Empty
        return self.decode(self.sock.recv())

    def get_nowait(self) -> tuple:
        import zmq

        try:
            return self.decode(self.sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            raise queue.Empty from None
