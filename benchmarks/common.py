"""Shared by the benchmark scripts: a JSON record with its provenance, timers, and the spans of a
torch.profiler trace."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import statistics
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnout.bench import provenance


def write_json(path: str | None, rows: list[dict[str, Any]], config: Any, **extra: Any) -> None:
    """{date, device, commit, command, python, torch, config, ...extra, results}; config: the run's settings
    (the parsed arguments, an argparse.Namespace or a dict)."""
    if path:
        cfg = {k: v for k, v in (config if isinstance(config, dict) else vars(config)).items() if k != "json"}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        doc = {**provenance(), "config": cfg, **extra, "results": rows}
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {path}")


def write_generated(texts: dict[Path, str], description: str) -> int:
    """The main of a script that generates files from the records: writes each path's text, or with --check
    exits 1 where a file is not up to date."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is not up to date")
    if ap.parse_args().check:
        return int(any(not p.is_file() or p.read_text() != text for p, text in texts.items()))
    for p, text in texts.items():
        p.write_text(text)
    print("wrote " + " and ".join(map(str, texts)))
    return 0


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


def captured(fn: Callable[[], object]) -> Any:
    """fn captured in a CUDA graph, after a run on a side stream (its allocations made, kernels compiled)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def version(name: str) -> str | None:
    """The installed version of distribution name, None where it is not installed."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# ---- torch.profiler traces ----
DEVICE_ACTIVITIES = {"kernel", "gpu_memcpy", "gpu_memset"}  # not gpu_user_annotation (a label's GPU copy)


@dataclass(frozen=True)
class Span:
    """A named interval of a trace, in µs from its start."""

    name: str
    start: float
    end: float

    @property
    def us(self) -> float:
        """The span's length in µs."""
        return self.end - self.start


def kernel_spans(events: Any) -> list[Span]:
    """The device-side work (kernels, memcpys, memsets) of a profiler's events(), graph replays included."""
    from torch.autograd import DeviceType

    spans = []
    for e in events:
        kind = getattr(e, "activity_type", None)
        if e.device_type != DeviceType.CUDA or (kind is not None and kind not in DEVICE_ACTIVITIES):
            continue
        if not getattr(e, "is_user_annotation", False):
            spans.append(Span(e.name, e.time_range.start, e.time_range.end))
    return spans


def label_ranges(events: Any, label: str) -> list[Span]:
    """The host-side record_function ranges named label, in time order."""
    from torch.autograd import DeviceType

    spans = [
        Span(label, e.time_range.start, e.time_range.end)
        for e in events
        if e.name == label and e.device_type == DeviceType.CPU
    ]
    return sorted(spans, key=lambda s: s.start)


def assign(kernels: list[Span], ranges: list[Span]) -> list[list[Span]]:
    """For each range, the kernels that start inside it."""
    kernels = sorted(kernels, key=lambda k: k.start)
    starts = [k.start for k in kernels]
    return [kernels[bisect_left(starts, r.start) : bisect_right(starts, r.end)] for r in ranges]


def busy_us(spans: list[Span]) -> float:
    """Length of the union of the spans (kernels of several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total


def short(name: str, width: int = 60) -> str:
    """A kernel's name without "void " and a C++ parameter list, cut to width."""
    s = re.sub(r"(?<=[\w>])\(.*\)$", "", name.removeprefix("void "))
    return s if len(s) <= width else s[: width - 3] + "..."
