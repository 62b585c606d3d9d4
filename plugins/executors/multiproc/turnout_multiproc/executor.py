"""The driver side: one spawned process per rank, one pipe to each.

Every message is broadcast to all ranks and every rank answers each one, in order. execute_model only
sends; its answers are read with the next sample_tokens or collective_rpc. Each read waits on the pipes and
on the process sentinels together, under a deadline (config.rpc_timeout seconds), so a rank that dies or
never answers ends the engine with a TurnoutError instead of a hang. Each rank also beats every
TURNOUT_MULTIPROC_HEARTBEAT_INTERVAL_S from a thread of its own, into shared memory; a rank whose beat is
HEARTBEAT_MISSES intervals old is hung (stopped, or stuck where no thread runs), and ends the engine
naming it, within seconds and whether or not a step is under way.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from turnout import EngineConfig, TurnoutError
from turnout.executor import Executor, ModelRunnerOutput, SchedulerOutput, Selection, free_port, plan_ranks
from turnout_multiproc.envs import HEARTBEAT_INTERVAL, HEARTBEAT_MISSES
from turnout_multiproc.worker import run_worker

logger = logging.getLogger("turnout")


class MultiprocExecutor(Executor):
    start_method = "spawn"  # workers re-run the main script: the engine checks its __main__ guard

    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.world_size = config.world_size
        self.timeout = float(config.rpc_timeout)
        self.interval = HEARTBEAT_INTERVAL.value
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
        ctx = mp.get_context(self.start_method)
        infos = plan_ranks(config, selection, f"tcp://127.0.0.1:{free_port()}")
        self.init_method = infos[0].init_method  # replicas that share expert parallelism share one
        self.output_rank = infos[0].output_rank
        self.beats = ctx.RawArray("d", len(infos))  # each rank's last beat; 0: not started yet
        for i, info in enumerate(infos):
            parent, child = ctx.Pipe()
            name = f"turnout-rank{info.rank}"
            args = (info, child, self.beats, i, self.interval)
            p = ctx.Process(target=run_worker, args=args, name=name, daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._owed = ["start-up"]
        logger.info("multiproc: %d ranks, rendezvous %s", self.world_size, self.init_method)

    # ---- the Executor interface ----
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._send("execute_model", (scheduler_output,))

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        self._send("sample_tokens", (grammar_output,))
        return self._collect("sample_tokens")[self.output_rank]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        self._send(method, args, kwargs)
        return self._collect(method)

    def check_health(self) -> None:
        if not self._finalizer.alive:
            raise TurnoutError("executor multiproc is shut down; start a new engine")
        if any(not p.is_alive() for p in self.procs):
            self._fail(self._death())
        self._check_beats()

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
        owed = dict.fromkeys(range(len(self.conns)), n)  # rank -> answers still to read
        results: list[Any] = [None] * len(self.conns)
        deadline = time.monotonic() + self.timeout
        try:
            while owed:
                ready = self._wait(owed, deadline, what)
                for rank in [r for r in owed if self.conns[r] in ready]:
                    value = self._receive(rank, self._owed[n - owed[rank]])
                    owed[rank] -= 1
                    if not owed[rank]:
                        results[rank] = value
                        del owed[rank]
                if any(p.sentinel in ready for p in self.procs):  # answers first: they may name the cause
                    self._fail(self._death())
        except KeyboardInterrupt:
            self.shutdown(grace=1.0)
            raise
        self._owed = []
        return results

    def _wait(self, owed: dict[int, int], deadline: float, what: str) -> list[Any]:
        """The pipes and sentinels that became ready; fails once the deadline passes or a rank hangs."""
        self._check_beats()
        left = deadline - time.monotonic()
        if left <= 0:
            self._fail(
                f"worker rank(s) {sorted(owed)} did not answer {what} within {self.timeout:.0f}s "
                "(raise rpc_timeout to wait longer); the engine is shut down"
            )
        waitables = [*(self.conns[r] for r in owed), *(p.sentinel for p in self.procs)]
        return wait(waitables, timeout=min(left, self.interval))

    def _check_beats(self) -> None:
        """Fail naming the first live rank whose heartbeat is HEARTBEAT_MISSES intervals old; it is killed
        first, as a stopped process ignores the SIGTERM of the shutdown."""
        now = time.monotonic()
        for rank, beat in enumerate(self.beats):
            p = self.procs[rank]
            if beat and now - beat > HEARTBEAT_MISSES * self.interval and p.exitcode is None:
                p.kill()
                self._fail(
                    f"worker rank {rank} (pid {p.pid}) hung: no heartbeat for {now - beat:.1f}s, one was "
                    f"due every {self.interval:g}s (TURNOUT_MULTIPROC_HEARTBEAT_INTERVAL_S); the engine is "
                    "shut down"
                )

    def _receive(self, rank: int, method: str) -> Any:
        """One answer of rank to method; a rank that failed ends the engine."""
        try:
            status, value = self.conns[rank].recv()
        except (EOFError, OSError):
            self._fail(self._death())
        if status == "error":  # a peer that died makes the others fail: name the dead one
            logger.error("worker rank %d failed in %s:\n%s", rank, method, value)
            last = value.strip().splitlines()[-1]
            why = f"worker rank {rank} failed in {method}: {last}; the engine is shut down"
            self._fail(self._dead_rank(skip=rank, patience=0.2) or why)
        return value

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
