"""CUDA-graph modes on a Qwen3-0.6B-shaped random bf16 model: correctness against NONE, decode TPOT,
throughput on three workloads, capture time and graph memory.

  python benchmarks/bench_graphs.py --backends triton flashinfer --json /tmp/graphs.json   # suite: graphs
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402
from random_models import make_random_model  # noqa: E402

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


class _CaptureLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def workloads(quick: bool) -> dict[str, list[tuple[int, int]]]:
    rng = random.Random(0)
    scale = 8 if quick else 1
    return {
        "decode_heavy": [(128, 1024 // scale)] * (256 // scale),
        "prefill_heavy": [(2048, 16)] * (512 // scale),
        "mixed": [(rng.randint(100, 1024), rng.randint(100, 1024) // scale) for _ in range(256 // scale)],
    }


def run(llm, reqs: list[tuple[int, int]], seed: int = 0) -> tuple[float, list[list[int]]]:
    from turnout import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(p)] for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, [o.token_ids for o in outs]


def tpot(llm, batch: int, steps: int = 64) -> float:
    """Decode time per output token (ms) at a fixed batch: (time for 1+steps tokens - time for 1) / steps."""
    reqs_long = [(32, steps + 1)] * batch
    reqs_short = [(32, 1)] * batch
    t_long, _ = run(llm, reqs_long, seed=batch)
    t_short, _ = run(llm, reqs_short, seed=batch)
    return (t_long - t_short) / steps * 1e3


def forward_ms(llm, batch: int, steps: int = 64) -> float:
    """Median GPU-synchronised time (ms) of ModelRunner.execute_model (inputs, forward, logits) over the
    decode steps at this batch: TPOT minus this is the host's share (scheduler, sampler, detokenizer)."""
    mr = llm.engine.executor.worker.runner
    orig, times = mr.execute_model, []

    def timed(out) -> None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        orig(out)
        torch.cuda.synchronize()
        if out.requests and all(len(r.token_ids) == 1 for r in out.requests):
            times.append(time.perf_counter() - t)

    mr.execute_model = timed
    try:
        run(llm, [(32, steps + 1)] * batch, seed=batch)
    finally:
        mr.execute_model = orig
    return sorted(times)[len(times) // 2] * 1e3


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    total = sum(len(s) for s in a)
    return same / total, sum(sa == sb for sa, sb in zip(a, b))


def compare_with_none(rows: list[dict], seqs: dict[tuple[str, str], list[list[int]]]) -> None:
    """Fill each row's agreement with its backend's NONE run, whichever of the two ran first."""
    for row in rows:
        if (none := seqs.get((row["backend"], "NONE"))) is not None:
            tok_agree, seq_same = agreement(seqs[row["backend"], row["mode"]], none)
            row.update(tok_agree_vs_none=tok_agree, seqs_identical=f"{seq_same}/{len(none)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["triton"])
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--model-dir", default="/tmp/turnout-qwen3-0.6b")
    ap.add_argument("--quick", action="store_true", help="1/8 of every workload")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--tpot-batches", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--forward-batches", type=int, nargs="*", default=[1], help="time execute_model alone")
    ap.add_argument("--unfused", action="store_true", help="TURNOUT_FUSED_KERNELS=0: the eager torch layers")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.unfused:
        os.environ["TURNOUT_FUSED_KERNELS"] = "0"
    from turnout import LLM

    path = make_random_model(Path(args.model_dir), "qwen3-0.6b")
    log = _CaptureLog()
    logging.getLogger("turnout").addHandler(log)
    logging.getLogger("turnout").setLevel(logging.INFO)
    rng = random.Random(1)
    check = [(rng.randint(16, 700), 32) for _ in range(64)]  # mixed, chunked by the 512-token budget
    rows, seqs = [], {}  # seqs: (backend, mode) -> the check workload's outputs
    warm: set[str] = set()  # backends whose kernels this process has compiled
    for backend in args.backends:
        for mode in args.modes:
            log.lines.clear()
            t0 = time.perf_counter()
            llm = LLM(str(path), attention_backend=backend, cudagraph_mode=mode, max_num_batched_tokens=2048,
                      max_num_seqs=256, gpu_memory_utilization=0.85)  # fmt: skip
            startup = time.perf_counter() - t0
            eff = llm.selection.effective_graph.name
            capture = next((line for line in log.lines if line.startswith("captured")), "")
            # correctness: the same mixed workload, chunked prefill active (budget 512 via a second engine
            # would double start-up; 64 prompts of up to 700 tokens over a 2048 budget still chunk)
            _, seqs[backend, mode] = run(llm, check, seed=7)
            row = {"backend": backend, "mode": mode, "effective": eff, "startup_s": startup,
                   "tok_agree_vs_none": "no NONE run", "seqs_identical": "-"}  # fmt: skip
            compare_with_none(rows + [row], seqs)
            for b in args.tpot_batches:
                row[f"tpot_ms_b{b}"] = tpot(llm, b)
            for b in args.forward_batches:
                row[f"forward_ms_b{b}"] = forward_ms(llm, b)
            if not args.skip_throughput:
                if backend not in warm:  # a process's first engine compiles the Triton kernels: untimed
                    for reqs in workloads(quick=True).values():
                        run(llm, reqs[:16])
                    warm.add(backend)
                for name, reqs in workloads(args.quick).items():
                    dt, outs = run(llm, reqs)
                    row[f"{name}_tok_s"] = sum(len(o) for o in outs) / dt
                    row[f"{name}_s"] = dt
            row["capture"] = capture.replace("captured ", "")
            rows.append(row)
            print(row, flush=True)
            write_json(args.json, rows, args, model="Qwen3-0.6B-shaped, random bf16 weights",
                       quick=args.quick, fused_kernels=not args.unfused)  # fmt: skip
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print_table(rows)
    write_json(args.json, rows, args, model="Qwen3-0.6B-shaped, random bf16 weights", quick=args.quick,
                       fused_kernels=not args.unfused)  # fmt: skip


if __name__ == "__main__":
    main()
