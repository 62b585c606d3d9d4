"""The driver side: one Ray actor per rank, each pinned to one bundle of a placement group.

The bundles ({"GPU": 1} each, or {"CPU": 1} on the CPU) are placed PACK: on as few nodes as hold them,
spanning nodes where one is not enough. Ranks are numbered node by node, the node of bundle 0 first, so a
tensor-parallel group stays on one node where it can; rank 0's node hosts the torch.distributed rendezvous.

Every call goes to every actor. execute_model only sends; its answers are awaited with the next
sample_tokens, collective_rpc or check_health, first failure first, under config.rpc_timeout. A dead actor
or a raised exception shuts the engine down with a TurnoutError that names the rank.

The driver joins the cluster at RAY_ADDRESS (`ray start --head` there), or the one this process already
joined, or starts a local one sized for the job; it disconnects only from a connection it opened, once its
last executor is gone.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, NoReturn

import ray
from ray import cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from turnout import EngineConfig, TurnoutError
from turnout.executor import Executor, ModelRunnerOutput, SchedulerOutput, Selection, cpu_cores, plan_ranks
from turnout_ray import RAY_ADDRESS
from turnout_ray.actor import RankActor

logger = logging.getLogger("turnout")
OBJECT_STORE_BYTES = 200 << 20  # a local cluster's object store: calls carry scheduler outputs, not tensors


@dataclass
class _Connection:
    users: int = 0  # live executors on the Ray connection this module opened; 0: none, or not ours


_conn = _Connection()


@dataclass
class _Held:
    """What one executor must give back; the finalizer holds this, never the executor."""

    actors: list[Any] = field(default_factory=list)
    pg: PlacementGroup | None = None
    joined: bool = False  # counted in _conn.users


def _connect(world_size: int, cuda: bool) -> bool:
    """Join Ray; True when this module's connection is used (and counted)."""
    if not ray.is_initialized():
        ray.init(**init_args(world_size, cuda))
    elif not _conn.users:
        return False  # the caller's own ray.init: theirs to shut down
    _conn.users += 1
    return True


def init_args(world_size: int, cuda: bool) -> dict[str, Any]:
    """RAY_ADDRESS's cluster, or a new local instance sized for the job ("local": even where a `ray start`
    left one behind)."""
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address := RAY_ADDRESS.value:
        return {"address": address, **quiet}
    cpus = None if cuda else max(world_size, cpu_cores())
    store = {"include_dashboard": False, "object_store_memory": OBJECT_STORE_BYTES}
    return {"address": "local", "num_cpus": cpus, **store, **quiet}


def _release(held: _Held) -> None:
    """Kill the actors, free the bundles, and leave Ray if this was its last user; safe to repeat."""
    actors, pg, held.actors, held.pg = held.actors, held.pg, [], None
    try:
        if ray.is_initialized():
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if pg is not None:
                remove_placement_group(pg)
    finally:
        if held.joined:
            held.joined = False
            _conn.users -= 1
            if not _conn.users and ray.is_initialized():
                ray.shutdown()


def _last_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[-1].rstrip(".") if lines else type(e).__name__


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.world_size = config.world_size
        self.timeout = float(config.rpc_timeout)
        self.cuda = selection.platform.is_cuda
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, int]] = []  # (node IP, pid) of each rank
        self._owed: dict[Any, tuple[int, str]] = {}  # ObjectRef -> (rank, method) not yet awaited
        self._held = _Held()
        self._finalizer = weakref.finalize(self, _release, self._held)
        try:
            self._held.joined = _connect(self.world_size, self.cuda)
            self._place()
            self._start(config, selection)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [pid for _, pid in self.nodes]

    def _place(self) -> None:
        """One bundle and one actor per rank; ranks ordered node by node, bundle 0's node first."""
        res, n = ("GPU" if self.cuda else "CPU"), self.world_size
        have = ray.cluster_resources().get(res, 0)
        if have < n:
            raise TurnoutError(
                f"executor ray: world size {n} needs {n} {res} in the Ray cluster, it has {have:g}; "
                "add nodes (ray start --address=<head>) or lower tensor/pipeline_parallel_size"
            )
        self._held.pg = pg = placement_group([{res: 1}] * n, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=self.timeout)
        except GetTimeoutError:
            raise TurnoutError(
                f"executor ray: {n} {res} bundles were not placed within {self.timeout:.0f}s (held by "
                "other jobs?); free them or raise rpc_timeout"
            ) from None
        opts = {"num_gpus": 1, "num_cpus": 0} if self.cuda else {"num_cpus": 1}
        cls = ray.remote(RankActor)
        for i in range(n):
            where = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            self._held.actors.append(cls.options(scheduling_strategy=where, max_restarts=0, **opts).remote())
        self.actors = self._held.actors
        nodes = self._collect(self._send("node", (), "start-up"))
        order = sorted(range(n), key=lambda i: (nodes[i][0] != nodes[0][0], nodes[i][0], i))
        self.actors, self.nodes = [self.actors[i] for i in order], [nodes[i] for i in order]

    def _start(self, config: EngineConfig, selection: Selection) -> None:
        port = self._one(0, "free_port", "start-up")
        self.init_method = init = f"tcp://{self.nodes[0][0]}:{port}"
        local = [0] * self.world_size  # Ray shows each actor its own GPU only
        infos = plan_ranks(config, selection, init, local, cloudpickle.dumps)
        self.output_rank = infos[0].output_rank
        refs = [a.start.remote(info) for info, a in zip(infos, self.actors)]
        self._owed.update({ref: (rank, "start-up") for rank, ref in enumerate(refs)})
        self._collect(refs)
        hosts = len({ip for ip, _ in self.nodes})
        logger.info("ray: %d ranks on %d node(s), rendezvous %s", self.world_size, hosts, init)

    # ---- the Executor interface ----
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._send("execute_model", (scheduler_output,))

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        return self._collect(self._send("sample_tokens", (grammar_output,)))[self.output_rank]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return self._collect(self._send("call", (method, args, kwargs or {}), method))

    def check_health(self) -> None:
        self._collect(self._send("ping", (), "check_health"))

    def shutdown(self) -> None:
        """Kill every actor, free the placement group, leave Ray if ours; safe to call any number of times."""
        if (detached := self._finalizer.detach()) is not None:
            _release(*detached[2])

    # ---- messaging ----
    def _send(self, fn: str, args: tuple = (), what: str = "") -> list[Any]:
        if not self._finalizer.alive:
            raise TurnoutError("executor ray is shut down; start a new engine")
        refs = [getattr(a, fn).remote(*args) for a in self.actors]
        self._owed.update({ref: (rank, what or fn) for rank, ref in enumerate(refs)})
        return refs

    def _one(self, rank: int, fn: str, what: str) -> Any:
        ref = getattr(self.actors[rank], fn).remote()
        self._owed[ref] = (rank, what)
        return self._collect([ref])[0]

    def _collect(self, refs: list[Any]) -> list[Any]:
        """Await every owed answer, the first to fail first; return those of refs."""
        owed, self._owed = self._owed, {}
        values: dict[Any, Any] = {}
        left, deadline = list(owed), time.monotonic() + self.timeout
        try:
            while left:
                ready, left = ray.wait(left, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    late, method = sorted({owed[r][0] for r in left}), owed[left[0]][1]
                    self._fail(
                        f"worker rank(s) {late} did not answer {method} within {self.timeout:.0f}s "
                        "(raise rpc_timeout to wait longer); the engine is shut down"
                    )
                values[ready[0]] = self._value(ready[0], *owed[ready[0]])
        except KeyboardInterrupt:
            self.shutdown()
            raise
        return [values[r] for r in refs]

    def _value(self, ref: Any, rank: int, method: str) -> Any:
        try:
            return ray.get(ref)
        except RayActorError as e:
            self._fail(self._died(rank, e))
        except RayError as e:  # the rank raised; a peer that died makes the others fail: name the dead one
            logger.error("worker rank %d failed in %s:\n%s", rank, method, e)
            why = f"worker rank {rank} failed in {method}: {_last_line(e)}; the engine is shut down"
            self._fail(self._dead_rank(skip=rank) or why)

    def _died(self, rank: int, e: RayActorError) -> str:
        where = f" (node {self.nodes[rank][0]}, pid {self.nodes[rank][1]})" if rank < len(self.nodes) else ""
        return f"worker rank {rank}{where} died: {_last_line(e)}; the engine is shut down"

    def _dead_rank(self, skip: int, patience: float = 1.0) -> str | None:
        """A rank whose actor is gone, asked for up to `patience` s; a busy live rank does not answer."""
        pings = {a.ping.remote(): r for r, a in enumerate(self.actors) if r != skip}
        if not pings:
            return None
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=patience)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                return self._died(pings[ref], e)
        return None

    def _fail(self, message: str) -> NoReturn:
        self.shutdown()
        raise TurnoutError(message)
