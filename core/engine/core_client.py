"""The front's end of the engine core: the core in a process of its own (CoreProcClient, the server's
default), or in a thread of the front's process (CoreThreadClient; TURNOUT_ENABLE_MULTIPROCESSING=0).

Both take the front's commands (add, abort, drain, stop) and hand each CoreBatch to `deliver` on the
front's event loop. `dead` is set once the core can take no more requests; every request the front holds
then ends with an EngineDeadError batch, so a dead core never leaves a request waiting.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from turnout.config import EngineConfig
from turnout.engine.core import EngineCore, make_engine, run_engine_core
from turnout.engine.main_guard import check_main_guard
from turnout.engine.messages import CoreBatch, EngineDeadError, EngineInfo, EngineRequest
from turnout.errors import TurnoutError

logger = logging.getLogger("turnout")
Deliver = Callable[[CoreBatch], None]
POLL_S = 0.2  # a quiet output socket makes the front check this often that the core process lives


class CoreThreadClient:
    """The core in a thread: commands through a SimpleQueue, batches through loop.call_soon_threadsafe."""

    where = "thread"

    def __init__(self, config: EngineConfig, max_waiting_requests: int) -> None:
        engine = make_engine(config)
        self.info = EngineInfo.of(engine)
        self.core = EngineCore(engine, max_waiting_requests, self._send)
        self._thread: threading.Thread | None = None

    @property
    def dead(self) -> str | None:
        return self.core.dead

    def start(self, deliver: Deliver) -> None:
        self._loop, self._deliver = asyncio.get_running_loop(), deliver
        self._thread = threading.Thread(target=self.core.run, name="turnout-engine-core", daemon=True)
        self._thread.start()

    def add(self, reqs: Sequence[EngineRequest], key: int) -> None:
        with self.core.lock:  # a put after `dead` is set would never be answered
            if self.core.dead:
                raise EngineDeadError(self.core.dead)
            self.core.commands.put(("add", list(reqs), key))

    def abort(self, req_ids: list[str]) -> None:
        self.core.commands.put(("abort", req_ids))

    def drain(self, deadline: float) -> None:
        self.core.commands.put(("drain", deadline))  # SimpleQueue.put is reentrant: safe in a signal handler

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.core.commands.put(("stop",))
            self._thread.join(timeout)
        self.core.engine.shutdown()

    def _send(self, batch: CoreBatch) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop closed: nobody is left to hear
            pass


class CoreProcClient:
    """The core in a spawned process (CUDA-safe; its executor starts its own workers), over two ZeroMQ
    IPC sockets: commands out through a PUSH socket, batches in through a PULL socket read by an asyncio
    task. The process's exit, seen by that task, ends every pending request; the process leaves when this
    one dies (it watches its parent), and its workers leave with it."""

    where = "process"

    def __init__(self, config: EngineConfig, max_waiting_requests: int) -> None:
        import zmq

        check_main_guard("the engine core process")
        self.dead: str | None = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dir = tempfile.mkdtemp(prefix="turnout-core-")
        self._ctx = zmq.Context()
        self._input, self._output = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        addrs = []
        for sock, name in ((self._input, "input"), (self._output, "output")):
            sock.setsockopt(zmq.SNDHWM if sock is self._input else zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            addrs.append(f"ipc://{self._dir}/{name}")
            sock.bind(addrs[-1])
        args = (config, max_waiting_requests, *addrs, logger.getEffectiveLevel())
        self.proc = mp.get_context("spawn").Process(target=run_engine_core, args=args, name="turnout-core")
        try:
            self.proc.start()
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown(timeout=0)
            raise

    def _wait_ready(self) -> EngineInfo:
        from turnout.engine import serial

        while True:
            exited = self.proc.exitcode is not None
            if self._output.poll(POLL_S * 1000):
                kind, value = serial.unpack(self._output.recv())
                if kind == "error":
                    raise serial.decode_error(value)  # type: ignore[misc]
                return serial.decode_info(value)
            if exited:
                raise TurnoutError(
                    f"the engine core process exited with code {self.proc.exitcode} while starting; "
                    "TURNOUT_LOG_LEVEL=DEBUG shows why"
                )

    def start(self, deliver: Deliver) -> None:
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(
            self._read(zmq.asyncio.Socket.from_socket(self._output), deliver)
        )

    async def _read(self, sock: Any, deliver: Deliver) -> None:
        """Deliver every batch the core sends; once the process has exited and its last batch is read,
        end whatever is left with an EngineDeadError."""
        import zmq

        from turnout.engine import serial

        while True:
            exited = self.proc.exitcode is not None  # read first: a batch sent before the exit still counts
            if await sock.poll(POLL_S * 1000):
                while True:  # all that is queued, without a wake-up each
                    try:
                        batch = serial.decode_batch(self._output.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if isinstance(batch.fail, EngineDeadError):
                        self.dead = str(batch.fail)
                    try:
                        deliver(batch)
                    except Exception:  # noqa: BLE001 - as the event loop does with a callback that raised
                        logger.exception("delivering an engine core batch")
            elif exited:
                if self.dead is None:
                    self.dead = (
                        f"the engine core process died (exit code {self.proc.exitcode}); restart the server"
                    )
                    logger.error("%s", self.dead)
                    deliver(CoreBatch(time.monotonic(), [], [], None, EngineDeadError(self.dead)))
                return

    def add(self, reqs: Sequence[EngineRequest], key: int) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        if not self._put(("add", list(reqs), key)):
            raise EngineDeadError("the engine core process is gone; restart the server")

    def abort(self, req_ids: list[str]) -> None:
        self._put(("abort", req_ids))

    def drain(self, deadline: float) -> None:
        """Safe in a signal handler: the send happens on the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put, ("drain", deadline))
        else:
            self._put(("drain", deadline))

    def _put(self, cmd: tuple) -> bool:
        """Send a command; False when no core is connected to take it."""
        import zmq

        from turnout.engine import serial

        try:
            self._input.send(serial.encode_command(cmd), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (it stops its workers), else terminate, then kill it; safe to call again."""
        if self.proc.is_alive():
            self.dead = self.dead or "the server shut down"
            if self._put(("stop",)):
                self.proc.join(timeout)
        if self.proc.pid is not None:
            for stop in (self.proc.terminate, self.proc.kill):
                if self.proc.is_alive():
                    stop()
                    self.proc.join(2.0)
        if self._reader is not None:
            self._reader.cancel()
        if not self._ctx.closed:
            self._input.close()
            self._output.close()
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
