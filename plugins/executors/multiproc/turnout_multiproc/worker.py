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
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from turnout.config import EngineConfig
from turnout.distributed import init_parallel_groups, set_parallel_state
from turnout.executor import RankInfo
from turnout.selection import selection_from_payload
from turnout.worker.worker import Worker

logger = logging.getLogger("turnout")


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
    selection = selection_from_payload(config, payload)
    cuda = selection.platform.is_cuda
    if cuda:
        torch.cuda.set_device(info.rank)
    else:
        torch.set_num_threads(info.threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=info.init_method, rank=info.rank, world_size=info.world_size
    )
    # layers read the parallel state while the model is built
    dp = info.world_size // config.world_size  # replicas in this process group: they share expert parallelism
    state = init_parallel_groups(info.rank, info.world_size, info.tp_size, dp, config.enable_expert_parallel)
    set_parallel_state(state)
    return Worker(config, selection, local_rank=info.rank)


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
