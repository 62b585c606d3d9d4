"""Where the time of one decode step goes, kernel by kernel, under torch.profiler (issue #5).

Per-kernel and per-category GPU time per decode step, against the step's wall time, the engine's TPOT and
the weight-read floor (parameter bytes / --bandwidth).

  python benchmarks/profile_decode.py --modes FULL NONE --json /tmp/profile.json   # suite: profile

--batch requests (a 32-token prompt each, ignore_eos; default 1) on a Qwen3-0.6B-shaped random bf16 model. A
wrapper around the ModelRunner's execute_model and sample_tokens synchronises before and after each pure-
decode step and marks it with a record_function range (FORWARD, SAMPLE); a kernel counts for the step whose
range its start lies in, so prefill and everything between steps (scheduler, detokenizer) stay out, and the
sums are per step rather than whole-run totals divided by a step count. The first --warmup decode steps are
dropped.

Wall times come from a first, unprofiled pass (the profiler's CUPTI tracing slows the host and can stretch
graph replays); kernel times, counts and gaps come from the second, profiled pass. Categories go by kernel
name: qk_norm_rope (norm + rotary fused) counts as "rotary"; the eager torch kernels of --unfused (pow,
mean, mul, cat) land in "other"; everything in sample_tokens is "sampler".
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import time
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from bench_graphs import run, tpot  # noqa: E402
from common import print_table, write_json  # noqa: E402
from random_models import make_random_model  # noqa: E402

FORWARD, SAMPLE = "decode_forward", "decode_sample"  # record_function labels of a decode step's two halves
DEVICE_ACTIVITIES = {"kernel", "gpu_memcpy", "gpu_memset"}  # not gpu_user_annotation (our labels' GPU copy)
# first match wins, on the lower-cased name; the Triton names are those of core/layers/fused.py and
# plugins/attention/triton/turnout_triton/kernels.py
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("matmul", ("gemm", "gemv", "cublas", "nvjet", "cutlass", "xmma", "splitk")),
    ("attention", ("attention", "_decode_kernel", "_prefill_kernel", "decode", "prefill",
                   "flash", "fmha", "_fwd", "merge_state")),
    ("kv store", ("store", "cache", "append_paged_kv")),
    ("rotary", ("rope", "rotary")),
    ("norm", ("rms", "norm")),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
]  # fmt: skip


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # µs from the trace start
    end: float

    @property
    def us(self) -> float:
        return self.end - self.start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def is_decode(out) -> bool:
    return bool(out.requests) and all(len(r.token_ids) == 1 for r in out.requests)


class DecodeTimer:
    """Wraps runner.execute_model and runner.sample_tokens: each pure-decode call runs between two
    synchronisations inside a record_function range (FORWARD / SAMPLE); their wall times in µs."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.orig = runner.execute_model, runner.sample_tokens
        self.forward_us: list[float] = []
        self.sample_us: list[float] = []
        self._decode = False

    def __enter__(self) -> DecodeTimer:
        self.runner.execute_model, self.runner.sample_tokens = self._execute, self._sample
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.execute_model, self.runner.sample_tokens = self.orig

    def _timed(self, label: str, fn, times: list[float], *args: Any) -> Any:
        _sync()
        with record_function(label):
            t = time.perf_counter()
            res = fn(*args)
            _sync()  # inside the range: the step's kernels end before it does
            times.append((time.perf_counter() - t) * 1e6)
        return res

    def _execute(self, out) -> None:
        self._decode = is_decode(out)
        if not self._decode:
            return self.orig[0](out)
        return self._timed(FORWARD, self.orig[0], self.forward_us, out)

    def _sample(self):
        if not self._decode:
            return self.orig[1]()
        return self._timed(SAMPLE, self.orig[1], self.sample_us)


def kernel_spans(events) -> list[Span]:
    """The device-side work (kernels, memcpys, memsets) of a profiler's events(), graph replays included."""
    spans = []
    for e in events:
        kind = getattr(e, "activity_type", None)
        if e.device_type != DeviceType.CUDA or (kind is not None and kind not in DEVICE_ACTIVITIES):
            continue
        if getattr(e, "is_user_annotation", False) or e.name in (FORWARD, SAMPLE):
            continue
        spans.append(Span(e.name, e.time_range.start, e.time_range.end))
    return spans


def label_ranges(events, label: str) -> list[Span]:
    """The host-side record_function ranges named label, in time order."""
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


def categorize(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def short(name: str, width: int = 60) -> str:
    """Without "void " and a C++ parameter list, cut to width."""
    s = re.sub(r"(?<=[\w>])\(.*\)$", "", name.removeprefix("void "))
    return s if len(s) <= width else s[: width - 3] + "..."


def busy_us(spans: list[Span]) -> float:
    """Length of the union of the spans (kernels of several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total


def kernel_rows(phases: dict[str, list[list[Span]]]) -> list[dict[str, Any]]:
    """One row per (phase, kernel name): calls and µs per step of that phase, share of all kernel time."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for phase, steps in phases.items():
        for step in steps:
            for k in step:
                acc[phase, k.name][0] += 1 / len(steps)
                acc[phase, k.name][1] += k.us / len(steps)
    total = sum(us for _, us in acc.values()) or 1.0
    rows = [
        {"kernel": name, "where": phase, "category": "sampler" if phase == "sample" else categorize(name),
         "calls_per_step": calls, "us_per_step": us, "share_pct": 100 * us / total}
        for (phase, name), (calls, us) in acc.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_step"])


def category_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernel rows summed per category."""
    keys = ("calls_per_step", "us_per_step", "share_pct")
    acc: dict[str, dict[str, Any]] = {}
    for r in rows:
        a = acc.setdefault(r["category"], {"category": r["category"], **dict.fromkeys(keys, 0.0)})
        for k in keys:
            a[k] += r[k]
    return sorted(acc.values(), key=lambda r: -r["us_per_step"])


def step_stats(ranges: list[Span], steps: list[list[Span]]) -> dict[str, float]:
    """Medians over the forward steps: host time to the first kernel, first kernel start to last kernel
    end, and the GPU's idle time inside that span (launch gaps)."""
    pairs = [(r, s) for r, s in zip(ranges, steps) if s]
    if not pairs:
        return {}
    first = [min(k.start for k in s) - r.start for r, s in pairs]
    span = [max(k.end for k in s) - min(k.start for k in s) for _, s in pairs]
    idle = [sp - busy_us(s) for sp, (_, s) in zip(span, pairs)]
    med = statistics.median
    return {"first_kernel_after_us": med(first), "gpu_span_us": med(span), "gpu_idle_in_span_us": med(idle)}


def summarize(events, warmup: int) -> dict[str, Any]:
    """Kernel rows, categories and per-step totals of the decode steps in a profiler's events()."""
    kernels = kernel_spans(events)
    ranges = {p: label_ranges(events, lab)[warmup:] for p, lab in (("forward", FORWARD), ("sample", SAMPLE))}
    phases = {p: assign(kernels, r) for p, r in ranges.items() if r}
    rows = kernel_rows(phases)
    totals: dict[str, Any] = {"decode_steps": len(ranges["forward"])}
    for p, steps in phases.items():
        totals[f"kernels_per_step_{p}"] = sum(len(s) for s in steps) / len(steps)
        totals[f"kernel_us_per_step_{p}"] = sum(k.us for s in steps for k in s) / len(steps)
    totals.update(step_stats(ranges["forward"], phases.get("forward", [])))
    if ranges["forward"]:  # a check: replayed graphs whose kernels the trace lacks show up as few kernels
        launches = [Span(e.name, e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == DeviceType.CPU and e.name.startswith("cudaGraphLaunch")]  # fmt: skip
        per_step = assign(launches, ranges["forward"])
        totals["graph_launches_per_step"] = sum(len(s) for s in per_step) / len(per_step)
    return {"kernels": rows, "categories": category_rows(rows), "totals": totals}


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once


def profile_decode(
    llm, batch: int, steps: int, warmup: int, bandwidth: float, trace: Path | None, prompt_len: int
) -> dict[str, Any]:
    runner = llm.engine.executor.worker.runner
    reqs = [(prompt_len, warmup + steps + 1)] * batch
    with DecodeTimer(runner) as timer:  # unprofiled: the wall times, and a warm-up for the profiled pass
        run(llm, reqs)
    with DecodeTimer(runner), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(llm, reqs)
    if trace:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    res = summarize(prof.events(), warmup)
    nbytes = weight_bytes(runner.model)
    res["totals"].update(
        wall_us_forward=statistics.median(timer.forward_us[warmup:]),
        wall_us_sample=statistics.median(timer.sample_us[warmup:]),
        tpot_us=tpot(llm, batch) * 1e3,
        weight_bytes=nbytes,
        weight_floor_us=nbytes / bandwidth * 1e6,
    )
    t = res["totals"]  # the rest of a step: scheduler, detokenizer, the executor's calls
    t["host_outside_runner_us"] = t["tpot_us"] - t["wall_us_forward"] - t["wall_us_sample"]
    return res


def report(res: dict[str, Any], top: int) -> None:
    print_table(
        [
            {"kernel": short(r["kernel"]), "where": r["where"], "category": r["category"],
             "calls/step": r["calls_per_step"], "us/step": r["us_per_step"], "share %": r["share_pct"]}
            for r in res["kernels"][:top]
        ]
    )  # fmt: skip
    print()
    print_table(res["categories"])
    print()
    for k, v in res["totals"].items():
        print(f"  {k:28} {v:.2f}" if isinstance(v, float) else f"  {k:28} {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--modes", nargs="+", default=["FULL"])
    ap.add_argument("--model-dir", default="/tmp/turnout-qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens in each prompt")
    ap.add_argument("--steps", type=int, default=20, help="decode steps counted")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps dropped first")
    ap.add_argument("--top", type=int, default=20, help="kernel rows printed")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the weight-read floor")
    ap.add_argument("--unfused", action="store_true", help="TURNOUT_FUSED_KERNELS=0: the eager torch layers")
    ap.add_argument("--trace-dir", help="also write a Chrome trace per mode here")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    if args.unfused:
        os.environ["TURNOUT_FUSED_KERNELS"] = "0"
    from turnout import LLM

    path = make_random_model(Path(args.model_dir), "qwen3-0.6b")
    meta = dict(model="Qwen3-0.6B-shaped, random bf16 weights", backend=args.backend, batch=args.batch,
                steps=args.steps,
                warmup=args.warmup, bandwidth=args.bandwidth, fused_kernels=not args.unfused)  # fmt: skip
    results, summary = [], []
    for mode in args.modes:
        # async scheduling off: each decode step runs between the timer's synchronisations
        llm = LLM(str(path), attention_backend=args.backend, cudagraph_mode=mode, max_num_batched_tokens=2048,
                  max_num_seqs=256, gpu_memory_utilization=0.85, async_scheduling=False)  # fmt: skip
        eff = llm.selection.effective_graph.name
        name = f"decode_{args.backend}_{mode}_b{args.batch}.json"
        trace = Path(args.trace_dir) / name if args.trace_dir else None
        res = {"backend": args.backend, "mode": mode, "effective": eff}
        a = args
        res.update(profile_decode(llm, a.batch, a.steps, a.warmup, a.bandwidth, trace, a.prompt_len))
        print(f"\n== {args.backend} {mode} (effective {eff}), batch {args.batch}, per decode step")
        report(res, args.top)
        t = res["totals"]
        summary.append({"mode": mode, "kernels/step": t.get("kernels_per_step_forward", 0.0),
                        "kernel_us": t.get("kernel_us_per_step_forward", 0.0),
                        "gpu_idle_us": t.get("gpu_idle_in_span_us", 0.0), "wall_fwd_us": t["wall_us_forward"],
                        "wall_sample_us": t["wall_us_sample"], "host_other_us": t["host_outside_runner_us"],
                        "tpot_us": t["tpot_us"],
                        "floor_us": t["weight_floor_us"]})  # fmt: skip
        results.append(res)
        write_json(args.json, results, args, **meta)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print()
    print_table(summary)


if __name__ == "__main__":
    main()
