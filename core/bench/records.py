"""Result records: one dict per (workload, engine, run), each carrying its provenance; a file holds a list.

Every record has REQUIRED's fields and its workload's (BY_WORKLOAD), then more metrics, headed as COLUMNS
says. ratio_vs_<peer> is turnout's figure over the peer's in the same run (turnout-static: turnout with
tuned = off; turnout-bf16: turnout on the unquantized weights, beside an FP8 run); on the HF peers' subset, a
record has subset, ratio_vs_peer and ratio_vs_hf_generate. Latency's ttft_ms is {prompt length: ms}; its
ratios are tpot_ and ttft_ratio_vs_vllm (and _vs_static, _vs_bf16), ttft_skipped the lengths over
max_model_len. A structured record's unconstrained_output_tokens_per_s is the same prompts
without the schema, each to the tokens it produced constrained; structured_cost is 1 - the first over that;
num_completed counts the constrained requests their grammar ended. Structured runs are all "first" (prefix
caching off).

Where the device's ceilings are known (roofline.CEILINGS), a rate's record also has its run's floor (floor_s,
floor_output_tokens_per_s: the least time the run's work takes at the ceilings; a repeat's with its prompts
in the prefix cache), over_floor (its time over the floor's; 1 = at the floor) and fraction_of_floor, the
inverse (prefix: no_cache_over_floor, structured: unconstrained_over_floor). Latency records have
tpot_floor_ms, ttft_floor_ms ({prompt length: ms}), tpot_over_floor and ttft_over_floor.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from turnout.bench import peers
from turnout.errors import TurnoutError

REQUIRED = ("workload", "engine", "model", "device", "commit", "date", "command", "config")
BY_WORKLOAD = {
    "throughput": ("run", "output_tokens_per_s"),
    "wide": ("run", "output_tokens_per_s"),
    "latency": ("run", "tpot_ms", "ttft_ms"),
    "prefix": ("run", "speedup_vs_no_cache"),
    "structured": ("run", "structured_output_ratio", "num_constrained", "output_tokens_per_s",
                   "unconstrained_output_tokens_per_s", "structured_cost", "mean_output_len"),
}  # fmt: skip
RUN = {"engine": "engine", "run": "run", "requests": "requests", "output_tokens_per_s": "output tok/s"}
VS = {"ratio_vs_vllm": "x vLLM", "ratio_vs_nano_vllm": "x nano-vllm", "ratio_vs_static": "x static",
      "ratio_vs_bf16": "x bf16"}  # fmt: skip
VS_HF = {"ratio_vs_peer": "x HF generate_batch", "ratio_vs_hf_generate": "x HF generate"}
TAIL = {"over_floor": "x floor", "prefix_cache_hit_rate": "prefix-cache hits", "startup_s": "start-up (s)"}
COLUMNS = {  # each workload's table (the CLI's and docs/performance.md's): key -> header
    "throughput": {**RUN, **VS, **VS_HF, **TAIL},
    "wide": {
        **RUN, "seconds": "seconds", **VS, "floor_s": "floor (s)", **TAIL,
        "num_preemptions": "preemptions", "num_gpu_blocks": "KV blocks",
    },
    "latency": {
        "engine": "engine", "run": "run", "tpot_ms": "TPOT (ms)", "ttft_ms": "TTFT (ms) by prompt",
        "tpot_ratio_vs_vllm": "TPOT / vLLM's", "ttft_ratio_vs_vllm": "TTFT / vLLM's by prompt",
        "tpot_ratio_vs_static": "TPOT / static's", "ttft_ratio_vs_static": "TTFT / static's by prompt",
        "tpot_ratio_vs_bf16": "TPOT / bf16's", "ttft_ratio_vs_bf16": "TTFT / bf16's by prompt",
        "tpot_floor_ms": "TPOT floor (ms)", "tpot_over_floor": "TPOT x floor",
        "ttft_over_floor": "TTFT x floor by prompt", "startup_s": "start-up (s)",
    },
    "prefix": {
        "run": "run", "output_tokens_per_s": "output tok/s, cache on",
        "no_cache_output_tokens_per_s": "cache off", "speedup_vs_no_cache": "speedup",
        "over_floor": "x floor", "no_cache_over_floor": "cache off x floor", "startup_s": "start-up (s)",
    },
    "structured": {
        "structured_output_ratio": "share constrained", "requests": "requests",
        "num_completed": "grammars completed", "mean_output_len": "mean output len",
        "output_tokens_per_s": "output tok/s, constrained",
        "unconstrained_output_tokens_per_s": "unconstrained", "structured_cost": "cost",
        "over_floor": "x floor", "unconstrained_over_floor": "unconstrained x floor",
        "startup_s": "start-up (s)",
    },
}  # fmt: skip
ENGINES = ("turnout", *peers.PEERS)


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def commit() -> str:
    """BENCH_COMMIT where the tree is a copy without git metadata; else HEAD, '-dirty' with local edits."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = "-dirty" if git("status", "--porcelain", "-uno") else ""
        return git("rev-parse", "--short", "HEAD") + dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command() -> str:
    """The command line as typed: TURNOUT_* switches, then `turnout ...` or `python SCRIPT ...`."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("TURNOUT_")]
    argv0 = sys.argv[0]
    prog = "turnout" if Path(argv0).name in ("turnout", "cli.py") else f"python {argv0}"
    return " ".join([*env, prog, *map(shlex.quote, sys.argv[1:])])


def provenance() -> dict[str, Any]:
    import torch

    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    return {"device": device_name(), "commit": commit(), "date": date, "command": command(), **versions}


def check(rec: dict[str, Any]) -> None:
    """Raise TurnoutError naming the first missing or wrong field of a record."""
    if rec.get("workload") not in BY_WORKLOAD:
        raise TurnoutError(f"record workload {rec.get('workload')!r} is not one of {', '.join(BY_WORKLOAD)}")
    if missing := [k for k in REQUIRED + BY_WORKLOAD[rec["workload"]] if k not in rec]:
        raise TurnoutError(f"{rec['workload']} record of {rec.get('engine')} lacks {', '.join(missing)}")
    if rec["engine"] not in ENGINES:
        raise TurnoutError(f"record engine {rec['engine']!r} is not one of {', '.join(ENGINES)}")
    if rec["run"] not in ("first", "repeat"):
        raise TurnoutError(f"record run {rec['run']!r} is not 'first' or 'repeat'")


def write(
    records: list[dict[str, Any]] | dict[str, Any], out: str | Path, workload: str, device: str
) -> Path:
    """records (turnout bench's, each checked) or one document (bench serve's) to out: a .json file, or a
    folder that gets <UTC date-time>-<device>-<workload>[-<attention>][-async].json, spelt in [a-z0-9_-]; a
    name already taken gets -2, -3, ..., so no run overwrites another's file."""
    for rec in records if isinstance(records, list) else ():
        check(rec)
    path = Path(out)
    if path.suffix != ".json":
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
        slug = lambda s: re.sub(r"[^a-z0-9_]+", "-", s.lower()).strip("-")  # a name any path or URL takes
        recs = records if isinstance(records, list) else []
        cfg = next((r["config"] for r in recs if r["engine"] == "turnout"), {})
        tag = "".join(f"-{t}" for t in (cfg.get("attention"), cfg.get("async_scheduling") and "async") if t)
        name = slug(f"{device.split('(')[0].lower().removeprefix('nvidia ')}-{workload}{tag}")
        base, i = path / f"{stamp}-{name}", 1
        path = Path(f"{base}.json")
        while path.exists():
            i += 1
            path = Path(f"{base}-{i}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, dict):
        return " ".join(f"{k}:{fmt(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def table(records: list[dict[str, Any]], columns: dict[str, str] | None = None) -> str:
    """The records as aligned text: the columns (key -> header; default the first record's keys) any of
    them has; requests: its subset or num_prompts."""
    columns = columns or {k: k for k in (records or [{}])[0]}
    records = [{**r, "requests": r.get("subset") or r.get("num_prompts")} for r in records]
    keys = [k for k in columns if any(r.get(k) is not None for r in records)]
    rows = [[columns[k] for k in keys]] + [[fmt(r.get(k)) for k in keys] for r in records]
    widths = [max(len(r[i]) for r in rows) for i in range(len(keys))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows)


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TurnoutError("--plot needs matplotlib; fix: pip install 'turnout[bench]'") from None
    return plt


def plot(records: list[dict[str, Any]], metric: str, path: str | Path, floor: float | None = None) -> None:
    """Bars of one metric per engine and run, with the roofline floor as a line where it is known."""
    plt = pyplot()
    rows = [r for r in records if r.get(metric) is not None]
    label = lambda r: f"{r['engine']}\n{r['run']}" + (f"\n{r['subset']} req" if r.get("subset") else "")
    held = lambda r: f"\n{r['structured_output_ratio']:g} held" if "structured_output_ratio" in r else ""
    labels = [label(r) + held(r) for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(rows)), 4))
    colors = ["C0" if r["engine"] == "turnout" else "C7" for r in rows]
    ax.bar(labels, [r[metric] for r in rows], color=colors)
    if floor:
        ax.axhline(floor, color="C3", linestyle="--", label=f"roofline {fmt(floor)}")
        ax.legend()
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel(metric)
    ax.set_title(f"{rows[0]['workload']}: {rows[0]['model']} on {rows[0]['device']}" if rows else metric)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
