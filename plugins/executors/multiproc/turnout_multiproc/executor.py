"""The driver side: one spawned process per rank, one pipe to each.

Every message is broadcast to all ranks and every rank answers each one, in order. execute_model only
sends; its answers are read with the next sample_tokens or collective_rpc. Each read waits on the pipes and
on the process sentinels together, under a deadline (TURNOUT_RPC_TIMEOUT seconds, default 300), so a rank
that dies or hangs ends the engine with a TurnoutError instead of a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from turnout.config import EngineConfig
from turnout.engine.scheduler import SchedulerOutput
from turnout.errors import TurnoutError
from turnout.executor import Executor, RankInfo
from turnout.selection import Selection, worker_handoff
from turnout.worker.model_runner import ModelRunnerOutput
from turnout_multiproc.worker import run_worker

logger = logging.getLogger("turnout")
RPC_TIMEOUT_ENV = "TURNOUT_RPC_TIMEOUT"


def free_port() -> int:
    """A port nobody listens on now; rank 0 binds it for the rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rpc_timeout(config: EngineConfig) -> float:
    """Seconds to wait for an answer: config.rpc_timeout where the core has that field, else the env."""
    return float(getattr(config, "rpc_timeout", None) or os.environ.get(RPC_TIMEOUT_ENV) or 300)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class MultiprocExecutor(Executor):
    in_process = False  # the model runs in other processes: a DataParallelEngine may step us in a thread

    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.world_size = config.world_size
        self.output_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.timeout = rpc_timeout(config)
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._owed: list[str] = []  # the methods every rank still owes an answer to, oldest first
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, 5.0)
        try:
            self._start(config, selection)
            self.pids: list[int] = self._collect("start-up")
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, selection: Selection) -> None:
        ctx = mp.get_context("spawn")
        pinned, payload = worker_handoff(selection, config)
        # replicas that share expert parallelism form one process group: replica d's ranks follow d - 1's
        shared = config.expert_parallel_spans_dp
        dp_rank, dp = (config.data_parallel_rank, config.data_parallel_size) if shared else (0, 1)
        port = config.data_parallel_master_port if dp > 1 else free_port()
        self.init_method = init = f"tcp://127.0.0.1:{port}"
        threads = max(1, cpu_cores() // (self.world_size * config.data_parallel_size))
        level = logger.getEffectiveLevel()
        tp, first = config.tensor_parallel_size, dp_rank * self.world_size
        for rank in range(self.world_size):
            info = RankInfo(
                first + rank, dp * self.world_size, tp, init, first + self.output_rank, threads, level
            )
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=run_worker,
                args=(info, pinned, payload, child),
                name=f"turnout-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._owed = ["start-up"]
        logger.info("multiproc: %d ranks, rendezvous %s", self.world_size, init)

    # ---- the Executor interface ----
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._send("execute_model", (scheduler_output,))

    def sample_tokens(self) -> ModelRunnerOutput:
        self._send("sample_tokens")
        return self._collect("sample_tokens")[self.output_rank]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        self._send(method, args, kwargs)
        return self._collect(method)

    def check_health(self) -> None:
        if not self._finalizer.alive:
            raise TurnoutError("executor multiproc is shut down; start a new engine")
        if any(not p.is_alive() for p in self.procs):
            self._fail(self._death())

    def shutdown(self, grace: float = 5.0) -> None:
        """Ask every rank to stop, then terminate, then kill; safe to call any number of times."""
        if (detached := self._finalizer.detach()) is not None:
            procs, conns, _ = detached[2]
            _stop(procs, conns, grace)

    # ---- messaging ----
    def _send(self, method: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.check_health()
        data = pickle.dumps((method, args, kwargs or {}))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(self._death())
        self._owed.append(method)

    def _collect(self, what: str) -> list[Any]:
        """Read every owed answer; return the last one of each rank."""
        n = len(self._owed)
        owed = {conn: n for conn in self.conns}
        results: list[Any] = [None] * len(self.conns)
        rank_of = {conn: r for r, conn in enumerate(self.conns)}
        sentinels = [p.sentinel for p in self.procs]
        deadline = time.monotonic() + self.timeout
        try:
            while owed:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = sorted(rank_of[c] for c in owed)
                    self._fail(
                        f"worker rank(s) {late} did not answer {what} within {self.timeout:.0f}s "
                        f"(set {RPC_TIMEOUT_ENV} to wait longer); the engine is shut down"
                    )
                ready = wait([*owed, *sentinels], timeout=left)
                for conn in [c for c in ready if c in owed]:
                    rank = rank_of[conn]
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        self._fail(self._death())
                    if status == "error":  # a peer that died makes the others fail: name the dead one
                        method = self._owed[n - owed[conn]]
                        logger.error("worker rank %d failed in %s:\n%s", rank, method, value)
                        last = value.strip().splitlines()[-1]
                        why = f"worker rank {rank} failed in {method}: {last}; the engine is shut down"
                        self._fail(self._dead_rank(skip=rank, patience=0.2) or why)
                    owed[conn] -= 1
                    if not owed[conn]:
                        results[rank] = value
                        del owed[conn]
                if any(s in ready for s in sentinels):
                    self._fail(self._death())
        except KeyboardInterrupt:
            self.shutdown(grace=1.0)
            raise
        self._owed = []
        return results

    def _death(self) -> str:
        return self._dead_rank() or "a worker closed its pipe; the engine is shut down"

    def _dead_rank(self, skip: int = -1, patience: float = 1.0) -> str | None:
        """The first rank that exited, waiting up to `patience` s: a pipe closes before the exit code."""
        deadline = time.monotonic() + patience
        while True:
            for rank, p in enumerate(self.procs):
                if rank != skip and p.exitcode is not None:
                    return f"worker rank {rank} died (exit code {p.exitcode}); the engine is shut down"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _fail(self, message: str) -> NoReturn:
        self.shutdown(grace=0.0)
        raise TurnoutError(message)


def _stop(procs: list[BaseProcess], conns: list[Connection], grace: float) -> None:
    if grace > 0:
        stop = pickle.dumps(("shutdown", (), {}))
        for conn in conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
