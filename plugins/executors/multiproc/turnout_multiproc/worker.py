"""The body of one rank's process: build the RankWorker, then answer the driver's (method, args, kwargs)
messages with ("ok", value) or ("error", traceback) until told to stop."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from turnout.executor import RankInfo, RankWorker


def run_worker(info: RankInfo, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it shuts us down
    _exit_with_driver()
    try:
        rank = RankWorker(info)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    try:
        _serve(rank, conn)
    finally:
        rank.shutdown()


def _exit_with_driver() -> None:
    """Leave at once when the driver dies, even if this rank is stuck in a collective."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="turnout-driver-watch").start()


def _serve(rank: RankWorker, conn: Connection) -> None:
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone
        if method == "shutdown":
            conn.send(("ok", None))
            return
        try:
            result: Any = rank.call(method, *args, **kwargs)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
