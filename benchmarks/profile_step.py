"""Where an engine step's time goes, by kernel bucket (torch.profiler), at a model shape, phase by phase.

  python benchmarks/profile_step.py --random-model qwen3-8b --phases decode1,decode256,mixed256,prefill

One turnout.LLM (default selection) steps through each phase: decodeN, N requests of distinct prompts run
until all decode, then timed and profiled steps; mixedN, the same with a new short prompt prefilled in each
step (wide decode's steady state, as requests finish and others start); prefill, one request with
max_tokens 1 at a time. While profiled, the LM head and the sampler run between two synchronisations in
record_function ranges, so their kernels are "lm_head" and "sampling"; the rest go by name (BUCKETS).
busy = the union of kernel spans per step; idle = wall - busy (host gaps; PDL-overlapped kernels sum past
busy); floor = max(bytes, FLOPs) of the step at the H200's ceilings. --gaps puts each interval with no
kernel running under the innermost host stage at its midpoint (HOST_STAGES).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from turnout.bench import CEILINGS, RANDOM_MODELS, SHAPES, Shape, random_model, stages, sync, table, timed

sys.path.insert(0, str(Path(__file__).parent))
from common import Span, assign, busy_us, kernel_spans, label_ranges, short, write_json  # noqa: E402

LM_HEAD, SAMPLE = "step_lm_head", "step_sample"  # record_function labels
# first match wins, on the lower-cased name: turnout_triton's, FlashInfer's, FlashAttention's kernels (FA4's
# CuTe ones say "cutlass" too), cuBLAS and turnout's gemv_kernel, layers/triton_kernels.py's rms_norm,
# qk_norm_rope and silu_and_mul, the sampler's (gumbel_argmax, torch's argmax / topk / softmax / sort)
BUCKETS = [
    ("attention", ("_decode_kernel", "_prefill_kernel", "_merge_splits", "_store_kv", "flash", "fmha",
                   "attention", "merge_state", "batchdecode", "batchprefill", "paged", "reshape_and_cache")),
    ("gemm/gemv", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("norm/rotary/act", ("rms", "norm", "rope", "rotary", "silu", "gelu", "act_and_mul")),
    ("sampling", ("gumbel", "topk", "top_k", "softmax", "argmax", "multinomial", "sort", "exponential")),
    ("memcpy/memset", ("memcpy", "memset", "copy", "fill")),
]  # fmt: skip
H200 = CEILINGS["H200"]
# --gaps: each host stage of turnout.bench.STAGES profiled, as its record_function label; a gap goes to the
# latest-starting range that covers its midpoint, the innermost stage
MIXED_PROMPT = 32  # mixedN: N decode rows beside the prefill of one new request of this many tokens
HOST_STAGES = {s: f"host:{s}" for s in ("add_request", "schedule", "update", "prepare", "attention_metadata",
                                        "attention", "sample")} | {"model": "host:forward"}  # fmt: skip


def bucket_of(name: str) -> str:
    low = name.lower()
    return next((b for b, keys in BUCKETS if any(k in low for k in keys)), "other")


def labelled(llm, labels: dict[str, str], synced: bool):
    """While the block runs, each stage of labels runs inside a record_function range of its label, between
    two synchronisations where synced."""

    wait = sync if synced else lambda: None

    @contextmanager
    def ranged(label: str) -> Iterator[None]:
        wait()
        with record_function(label):
            yield
            wait()

    return stages(llm, lambda name, args: ranged(labels[name]), labels)


def device_kernels(events) -> list[Span]:
    """The device work of a profile, without the GPU copies of LM_HEAD's and SAMPLE's ranges."""
    return [k for k in kernel_spans(events) if k.name not in (LM_HEAD, SAMPLE)]


def idle_by_stage(events, steps: int, top: int) -> dict:
    """The intervals between kernels (union of spans) per step, by the innermost host stage at each one's
    midpoint ("none" outside every stage), and the longest intervals with the kernels around them."""
    kernels = sorted(device_kernels(events), key=lambda k: k.start)
    ranges = sorted((r for label in set(HOST_STAGES.values()) for r in label_ranges(events, label)),
                    key=lambda r: r.start)  # fmt: skip
    gaps, end, last = [], float("-inf"), None
    for k in kernels:
        if k.start > end and last is not None:
            gaps.append((k.start - end, (end + k.start) / 2, last.name, k.name))
        if k.end > end:
            end, last = k.end, k
    by: dict[str, float] = defaultdict(float)
    named = []
    for us, mid, before, after in gaps:
        inside = [r for r in ranges if r.start <= mid <= r.end]
        label = inside[-1].name if inside else "none"
        by[label] += us / steps
        named.append({"us": us, "stage": label, "after": short(before, 40), "before": short(after, 40)})
    rows = [{"stage": k, "us/step": v} for k, v in sorted(by.items(), key=lambda kv: -kv[1])]
    return {"idle_by_stage": rows, "longest_idle": sorted(named, key=lambda g: -g["us"])[:top]}


def summarize(events, steps: int, top: int) -> dict:
    """Per step: kernels, their summed and union (busy) time, each bucket's time; the top kernels."""
    kernels = device_kernels(events)
    tagged = {}
    for label, bucket in ((LM_HEAD, "lm_head"), (SAMPLE, "sampling")):
        for ks in assign(kernels, label_ranges(events, label)):
            tagged.update({id(k): bucket for k in ks})
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # calls, µs per step
    for k in kernels:
        a = acc[k.name, tagged.get(id(k)) or bucket_of(k.name)]
        a[0], a[1] = a[0] + 1 / steps, a[1] + k.us / steps
    total = sum((us for _, us in acc.values()), 0.0)
    buckets: dict[str, float] = defaultdict(float)
    for (_, b), (_, us) in acc.items():
        buckets[b] += us
    pct = lambda us: 100 * us / (total or 1.0)
    return {
        "kernels_per_step": len(kernels) / steps, "kernel_us": total, "busy_us": busy_us(kernels) / steps,
        "buckets": [{"bucket": b, "us/step": us, "share %": pct(us)}
                    for b, us in sorted(buckets.items(), key=lambda kv: -kv[1])],
        "top": [{"kernel": short(n), "bucket": b, "calls/step": c, "us/step": us, "share %": pct(us)}
                for (n, b), (c, us) in sorted(acc.items(), key=lambda kv: -kv[1][1])[:top]],
    }  # fmt: skip


def drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()
    engine.step()  # hands the finished ids to the worker, which drops their state
    for req_id in list(engine.requests):
        engine.pop_finished(req_id)


def decode_rows(phase: str) -> int:
    """N of a decodeN or mixedN phase."""
    return int(phase.removeprefix("decode").removeprefix("mixed"))


def run_phase(llm, phase: str, a: argparse.Namespace, rng: random.Random, shape: Shape) -> dict:
    from turnout import SamplingParams

    engine, sel = llm.engine, llm.selection
    vocab = engine.info.hf_config["vocab_size"]
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    t0 = time.perf_counter()
    if phase == "prefill":
        n_timed = n_prof = a.prefill_reps
        prompts = [prompt(a.prefill_len) for _ in range(1 + n_timed + n_prof)]
        sp = SamplingParams(temperature=0, max_tokens=1)

        def unit() -> None:
            engine.add_request(prompts.pop(), sp)
            drain(engine)

        unit()  # warm
        t = a.prefill_len
        tokens, kv_reads, pairs = t, 0, t * (t + 1) // 2
    else:
        batch, n_timed, n_prof = decode_rows(phase), a.steps, a.prof_steps
        # requests prefilled first decode while the others prefill: outputs to spare, aborted at the end
        sp = SamplingParams(temperature=0, max_tokens=a.warmup + n_timed + n_prof + 512, ignore_eos=True)
        reqs = [engine.add_request(prompt(a.context), sp) for _ in range(batch)]
        while min(len(r.output_token_ids) for r in reqs) < 2:  # every prefill done: pure decode from here
            engine.step()
        unit, new = engine.step, 0
        if phase.startswith("mixed"):  # each step also prefills a new request of MIXED_PROMPT tokens
            one, new = SamplingParams(temperature=0, max_tokens=1), MIXED_PROMPT
            unit = lambda: (engine.add_request(prompt(new), one), engine.step())
        for _ in range(a.warmup):
            unit()
        ctx = a.context + a.warmup + n_timed  # keys per request in the profiled steps
        tokens, kv_reads, pairs = batch + new, batch * ctx, batch * ctx + new * (new + 1) // 2
    wall = timed(lambda: [unit() for _ in range(n_timed)])[0] / n_timed * 1e6
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    heads = labelled(llm, {"logits": LM_HEAD, "sampler": SAMPLE}, synced=True)
    host = labelled(llm, HOST_STAGES, synced=False) if a.gaps else nullcontext()
    with heads, host, profile(activities=acts) as prof:
        prof_wall = timed(lambda: [unit() for _ in range(n_prof)])[0] / n_prof * 1e6
    if phase != "prefill":
        for r in reqs:
            engine.abort(r.req_id)
        drain(engine)
    res = {"phase": phase, "attention": sel.attention.chosen.name, "graph": sel.effective_graph.name,
           "async_scheduling": sel.async_scheduling, "token_budget": engine.config.max_num_batched_tokens,
           "wall_us": wall, "profiled_wall_us": prof_wall,
           **summarize(prof.events(), n_prof, a.top),
           **(idle_by_stage(prof.events(), n_prof, a.top) if a.gaps else {})}  # fmt: skip
    nbytes = shape.dtype_bytes * shape.weight_params + shape.kv_bytes_per_token * (kv_reads + tokens)
    flops = 2 * shape.weight_params * tokens + shape.attn_flops_per_pair * pairs
    floor = max(nbytes / H200.bytes_per_s, flops / H200.flops_per_s) * 1e6
    return {**res, "idle_us": wall - res["busy_us"], "floor_us": floor, "seconds": time.perf_counter() - t0}


def report(results: list[dict]) -> None:
    for r in results:
        if "error" in r:
            print(f"\n== {r['phase']}: FAILED {r['error']}")
            continue
        print(f"\n== {r['phase']} ({r['attention']}, graph {r['graph']}, async {r['async_scheduling']}, "
              f"budget {r['token_budget']}): {r['kernels_per_step']:.0f} kernels/step")  # fmt: skip
        for key in ("buckets", "top", "idle_by_stage", "longest_idle"):
            if key in r:
                print("\n" + table(r[key]))
    keys = ("phase", "wall_us", "profiled_wall_us", "busy_us", "idle_us", "kernel_us", "floor_us")
    print("\n" + table([{k: r[k] for k in keys} for r in results if "error" not in r]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--random-model", default="qwen3-8b", help="a random model of turnout bench (qwen3-8b-fp8-dynamic)"
    )
    ap.add_argument("--phases", default="decode1,decode256,prefill", help="decodeN, mixedN (N rows), prefill")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each decode request")
    ap.add_argument("--prefill-len", type=int, default=16384)
    ap.add_argument("--prefill-reps", type=int, default=3, help="prefills timed, and as many profiled")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before the timed ones")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--prof-steps", type=int, default=5, help="decode steps profiled")
    ap.add_argument("--top", type=int, default=10, help="kernels listed per phase")
    ap.add_argument("--gaps", action="store_true", help="also: GPU-idle time by the host stage it falls in")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/profile", help="JSON dir")
    args = ap.parse_args()
    if args.random_model not in RANDOM_MODELS:
        sys.exit(f"unknown random model {args.random_model}; known: {', '.join(sorted(RANDOM_MODELS))}")
    if not torch.cuda.is_available():
        print("no CUDA: a smoke run of the engine path, without kernel times", file=sys.stderr)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
    out = str(Path(args.out) / f"{stamp}-step-{args.random_model}.json")
    phases, results = args.phases.split(","), []
    model = f"{args.random_model}-shaped, random {'bf16' if args.random_model in SHAPES else 'FP8'} weights"
    max_len = max(args.prefill_len, args.context + args.warmup + args.steps + args.prof_steps + 512) + 1024
    path = random_model(args.random_model)
    shape = Shape.from_checkpoint(path, 2)
    # running rows at once: a mixedN step admits a new request beside its N decode rows
    rows = max((decode_rows(p) + p.startswith("mixed") for p in phases if p != "prefill"), default=0)
    kw = {"max_num_seqs": rows} if rows > 256 else {}
    if args.prefill_len > 16384:  # past the default budget of a large GPU: still one step
        kw["max_num_batched_tokens"] = args.prefill_len
    from turnout import LLM

    llm, rng = LLM(str(path), max_model_len=max_len, **kw), random.Random(0)
    for phase in phases:
        try:
            res = run_phase(llm, phase, args, rng, shape)
        except Exception:
            traceback.print_exc()
            res = {"phase": phase, "error": " | ".join(traceback.format_exc().strip().splitlines()[-3:])}
        results.append(res)
        print(phase, {k: v for k, v in res.items() if k not in ("buckets", "top")}, flush=True)
        write_json(out, results, args, model=model)
    llm.shutdown()
    report(results)


if __name__ == "__main__":
    main()
