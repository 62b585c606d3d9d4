"""The body of one rank's process: build the RankWorker, then answer the driver's (method, args, kwargs)
messages with ("ok", value) or ("error", traceback) until told to stop. A thread of its own writes the
rank's heartbeat (time.monotonic(), a clock all processes of the node share) into shared memory every
interval, whatever the main thread is doing."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from ctypes import Array
from multiprocessing.connection import Connection
from typing import Any

from turnout.executor import RankInfo, RankWorker, exit_with_parent


def run_worker(info: RankInfo, conn: Connection, beats: Array, index: int, interval: float) -> None:
    _start_heartbeat(beats, index, interval)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it shuts us down
    exit_with_parent("driver")  # even if this rank is stuck in a collective
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


def _start_heartbeat(beats: Array, index: int, interval: float) -> None:
    def beat() -> None:
        while True:
            beats[index] = time.monotonic()
            time.sleep(interval)

    threading.Thread(target=beat, daemon=True, name="turnout-heartbeat").start()
