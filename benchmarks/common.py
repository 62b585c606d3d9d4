"""Shared by the benchmark scripts: provenance of a result, a printed table, a JSON record."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or 'x86_64'})"
    )
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        # The GPU machine's copy of the tree has no true git state: its run scripts pass BENCH_COMMIT.
        "commit": os.environ.get("BENCH_COMMIT")
        or git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else ""),
        # the switches a run was made under (config.ENV_SWITCHES: TURNOUT_TRITON_GEMV=0 and the like)
        "command": " ".join(
            [
                *(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("TURNOUT_")),
                Path(sys.executable).name,
                *sys.argv,
            ]
        ),  # fmt: skip
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def write_json(path: str | None, rows: list[dict[str, Any]], **extra: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**provenance(), **extra, "results": rows}, indent=2) + "\n")
        print(f"wrote {path}")


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of fn on the current CUDA stream, by events, each run after a 256 MB write
    evicts L2."""
    import torch

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
