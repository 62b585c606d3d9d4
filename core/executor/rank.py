"""The rank bootstrap every multi-process executor shares (vLLM's WorkerWrapperBase).

Driver side, `plan_ranks`: one RankInfo per rank, with the rendezvous address, CPU threads per rank, the
output rank, and the driver's choices for the rank to rebuild. Rank side, `RankWorker`: join the process
group, set the parallel state, build the Worker, then answer the executor's calls. An executor plugin adds
only its transport: how a rank's process starts and how calls and answers travel.

sample_tokens runs on every rank (the last stage's TP ranks sample alike, from the same generator state);
only the output rank, the first TP rank of the last stage, sends its answer back.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from turnout import envs
from turnout.distributed import init_parallel_groups, set_parallel_state

if TYPE_CHECKING:
    from turnout.config import EngineConfig
    from turnout.engine.scheduler import SchedulerOutput
    from turnout.selection import Selection
    from turnout.structured_outputs import GrammarOutput
    from turnout.worker.outputs import ModelRunnerOutput

logger = logging.getLogger("turnout")


@dataclass(frozen=True)
class RankInfo:
    """Everything one rank needs to join the others and rebuild the driver's choices."""

    rank: int  # (dp_rank * pp + pp_rank) * tp + tp_rank; dp_rank > 0 where replicas share expert parallelism
    world_size: int  # of the process group: tp * pp, times dp where replicas share it
    tp_size: int
    local_rank: int  # the index of this rank's device among those its process sees
    init_method: str  # tcp://<host>:<port> of rank 0's rendezvous store
    output_rank: int  # the rank whose sampled tokens travel back, counted within this replica
    threads: int  # torch CPU threads of this rank's process
    log_level: int
    config: EngineConfig  # the driver's, every choice pinned by name
    selection: bytes | None  # the driver's Selection pickled; None: the rank selects again
    env: dict[str, str]  # the driver's TURNOUT_* switches, for a process that does not inherit them


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody on this node listens on now; rank 0 binds it for the rendezvous store."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def output_rank(config: EngineConfig) -> int:
    """The first TP rank of the last pipeline stage."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def plan_ranks(
    config: EngineConfig,
    selection: Selection,
    init_method: str,
    local_ranks: Sequence[int] | None = None,
    dumps: Callable[[Any], bytes] | None = None,
) -> list[RankInfo]:
    """One RankInfo per rank of this replica. local_ranks: each rank's device index (default: the rank's
    number, one node); dumps: how the Selection is pickled for the transport. Replicas that share expert
    parallelism join one process group at data_parallel_master_port, replica d's ranks after d - 1's."""
    from turnout.selection import worker_handoff

    pinned, payload = worker_handoff(selection, config, dumps)
    world, tp = config.world_size, config.tensor_parallel_size
    first, group = 0, world
    if config.expert_parallel_spans_dp:
        first, group = config.data_parallel_rank * world, config.data_parallel_size * world
        init_method = f"tcp://127.0.0.1:{config.data_parallel_master_port}"
    threads = max(1, cpu_cores() // (world * config.data_parallel_size))  # the node's cores, shared
    local = list(local_ranks) if local_ranks is not None else list(range(first, first + world))
    common = (output_rank(config), threads, logger.getEffectiveLevel(), pinned, payload, envs.environment())
    return [RankInfo(first + r, group, tp, local[r], init_method, *common) for r in range(world)]


class RankWorker:
    """One rank inside its own process: its process group, its parallel state and its Worker."""

    def __init__(self, info: RankInfo) -> None:
        from turnout.selection import selection_from_payload
        from turnout.worker.worker import Worker

        os.environ.update(info.env)
        self.is_output = info.rank % info.config.world_size == info.output_rank
        logging.basicConfig(format=f"%(levelname)s turnout rank {info.rank}: %(message)s")
        logger.setLevel(info.log_level if self.is_output else max(info.log_level, logging.WARNING))
        selection = selection_from_payload(info.config, info.selection)
        _join(info, selection.platform.is_cuda)
        self.worker = Worker(info.config, selection, local_rank=info.local_rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """This rank's share of the step's forward (Worker.execute_model); every rank gets the same step."""
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        """Sample the step's rows (Worker.sample_tokens): the sampled tokens on the output rank, None on
        every other."""
        out = self.worker.sample_tokens(grammar_output)
        return out if self.is_output else None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A Worker method by name; sample_tokens answers on the output rank only."""
        if method == "sample_tokens":
            return self.sample_tokens(*args)
        return self.worker.call(method, *args, **kwargs)

    def shutdown(self) -> None:
        """Shut the Worker down, then leave the process group."""
        self.worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(info: RankInfo, cuda: bool) -> None:
    if cuda:
        torch.cuda.set_device(info.local_rank)  # NCCL binds the current device
    else:
        torch.set_num_threads(info.threads)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size)
    # layers read the parallel state while the model is built
    dp = info.world_size // info.config.world_size  # replicas in this group: they share expert parallelism
    ep = info.config.enable_expert_parallel
    set_parallel_state(init_parallel_groups(info.rank, info.world_size, info.tp_size, dp, ep))


def exit_with_parent(name: str) -> None:
    """In a spawned process: leave at once when the process that started it dies, even while this one
    is stuck in a collective or a step. A thread waits on the parent's sentinel."""
    import multiprocessing as mp
    import threading
    from multiprocessing.connection import wait

    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name=f"turnout-{name}-watch").start()
