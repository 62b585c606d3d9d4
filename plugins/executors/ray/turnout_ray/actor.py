"""One rank inside a Ray actor: join the process group, build the Worker, answer the driver's calls.

Ray runs a (synchronous) actor's calls one at a time, in the order one caller sent them, so execute_model
and the sample_tokens after it reach the Worker in that order."""

from __future__ import annotations

import logging
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist

from turnout.config import EngineConfig
from turnout.distributed import ParallelState, set_parallel_state
from turnout.engine.scheduler import SchedulerOutput
from turnout.models.info import ModelInfo
from turnout.selection import Selection, select_all
from turnout.worker.model_runner import ModelRunnerOutput
from turnout.worker.worker import Worker

logger = logging.getLogger("turnout")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    tp_size: int
    init_method: str  # tcp://<IP of rank 0's node>:<a port free there>
    output_rank: int  # the rank whose sampled tokens travel back
    threads: int  # torch CPU threads (CPU only)
    log_level: int


class RankActor:
    """Wrapped by ray.remote in the driver; a plain class so it imports without a Ray cluster."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)  # the driver's TURNOUT_* settings (plugin limits, device)
        self.worker: Worker | None = None
        self.is_output = False

    def node(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A port nobody on this node listens on now; rank 0 binds it for the rendezvous store."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, info: RankInfo, config: EngineConfig, selection: bytes | None) -> None:
        logging.basicConfig(format=f"%(levelname)s turnout rank {info.rank}: %(message)s")
        logger.setLevel(
            info.log_level if info.rank == info.output_rank else max(info.log_level, logging.WARNING)
        )
        sel = _selection(config, selection)
        cuda = sel.platform.is_cuda
        if not cuda:
            torch.set_num_threads(info.threads)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(
            backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size
        )
        set_parallel_state(_parallel_state(info))
        self.is_output = info.rank == info.output_rank
        self.worker = Worker(config, sel, local_rank=0)  # Ray shows this actor its own GPU only

    def execute_model(self, out: SchedulerOutput) -> None:
        self._worker().execute_model(out)

    def sample_tokens(self) -> ModelRunnerOutput | None:
        out = self._worker().sample_tokens()  # every rank samples (same generator state); one answer travels
        return out if self.is_output else None

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return self._worker().call(method, *args, **kwargs)

    def ping(self) -> int:
        return os.getpid()

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("this rank was not started")
        return self.worker


def _parallel_state(info: RankInfo) -> ParallelState:
    """Rank = pp_rank * tp + tp_rank; every rank creates every group, in the same order."""
    tp, pp = info.tp_size, info.world_size // info.tp_size
    pp_rank, tp_rank = divmod(info.rank, tp)
    if pp == 1:
        return ParallelState(tp_rank, tp, 0, 1, dist.group.WORLD, None)
    tp_groups = [dist.new_group(list(range(p * tp, (p + 1) * tp))) for p in range(pp)]
    pp_groups = [dist.new_group(list(range(t, info.world_size, tp))) for t in range(tp)]
    return ParallelState(tp_rank, tp, pp_rank, pp, tp_groups[pp_rank], pp_groups[tp_rank])


def _selection(config: EngineConfig, payload: bytes | None) -> Selection:
    """The driver's Selection; where it does not travel, the same choices again (config pins them by name)."""
    if payload is not None:
        try:
            return pickle.loads(payload)
        except Exception as e:
            logger.warning("selection did not unpickle (%s: %s); selecting again", type(e).__name__, e)
    assert config.model is not None
    return select_all(config, ModelInfo.from_dir(config.model))
