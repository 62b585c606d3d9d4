"""Shared by the benchmark scripts: provenance of a result, a printed table, a JSON record."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnout.bench.records import provenance


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def write_json(path: str | None, rows: list[dict[str, Any]], config: Any, **extra: Any) -> None:
    """{date, device, commit, command, python, torch, config, ...extra, results}; config: the run's settings
    (the parsed arguments, an argparse.Namespace or a dict)."""
    if path:
        cfg = {k: v for k, v in (config if isinstance(config, dict) else vars(config)).items() if k != "json"}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        doc = {**provenance(), "config": cfg, **extra, "results": rows}
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
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
