"""One rank inside a Ray actor: join the process group, build the Worker, answer the driver's calls.

Ray runs a (synchronous) actor's calls one at a time, in the order one caller sent them, so execute_model
and the sample_tokens after it reach the Worker in that order."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import ray
import torch
import torch.distributed as dist

from turnout.config import EngineConfig
from turnout.distributed import init_parallel_groups, set_parallel_state
from turnout.engine.scheduler import SchedulerOutput
from turnout.executor import RankInfo
from turnout.selection import selection_from_payload
from turnout.worker.model_runner import ModelRunnerOutput
from turnout.worker.worker import Worker

logger = logging.getLogger("turnout")


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
        sel = selection_from_payload(config, selection)
        cuda = sel.platform.is_cuda
        if not cuda:
            torch.set_num_threads(info.threads)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(
            backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size
        )
        ep = config.enable_expert_parallel
        set_parallel_state(init_parallel_groups(info.rank, info.world_size, info.tp_size, expert_parallel=ep))
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
