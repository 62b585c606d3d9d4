"""The body of one worker process: join the process group, build the Worker for this rank, then answer the
driver's (method, args, kwargs) messages with ("ok", value) or ("error", traceback) until told to stop."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from turnout.config import EngineConfig
from turnout.distributed import ParallelState, set_parallel_state
from turnout.models.info import ModelInfo
from turnout.selection import Selection, select_all
from turnout.worker.worker import Worker

logger = logging.getLogger("turnout")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    tp_size: int
    init_method: str  # tcp://127.0.0.1:<port picked by the driver>
    output_rank: int  # the rank whose sampled tokens the driver returns
    threads: int  # torch CPU threads of this process
    log_level: int


def run_worker(info: RankInfo, config: EngineConfig, selection: bytes | None, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it shuts us down
    _exit_with_driver()
    logging.basicConfig(format=f"%(levelname)s turnout rank {info.rank}: %(message)s")
    logger.setLevel(info.log_level if info.rank == info.output_rank else max(info.log_level, logging.WARNING))
    try:
        worker = _build(info, config, selection)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    try:
        _serve(worker, conn, info.rank == info.output_rank)
    finally:
        dist.destroy_process_group()


def _exit_with_driver() -> None:
    """Leave at once when the driver dies, even if this rank is stuck in a collective."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="turnout-driver-watch").start()


def _build(info: RankInfo, config: EngineConfig, payload: bytes | None) -> Worker:
    selection = _selection(config, payload)
    cuda = selection.platform.is_cuda
    if cuda:
        torch.cuda.set_device(info.rank)
    else:
        torch.set_num_threads(info.threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=info.init_method, rank=info.rank, world_size=info.world_size
    )
    set_parallel_state(_parallel_state(info))  # layers read it while the model is built
    return Worker(config, selection, local_rank=info.rank)


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
    """The driver's own Selection; if it did not pickle, the same choices made again here (config pins
    them by name)."""
    if payload is not None:
        try:
            return pickle.loads(payload)
        except Exception as e:
            logger.warning("selection did not unpickle (%s: %s); selecting again", type(e).__name__, e)
    assert config.model is not None
    return select_all(config, ModelInfo.from_dir(config.model))


def _serve(worker: Worker, conn: Connection, is_output: bool) -> None:
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone
        if method == "shutdown":
            conn.send(("ok", None))
            return
        try:
            result: Any = worker.call(method, *args, **kwargs)
            if method == "sample_tokens" and not is_output:
                result = None  # the last stage's TP ranks all sample alike; only one answer travels
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
