"""Parallelism (issue #6) on a Qwen3-0.6B-shaped random bf16 model: greedy outputs of each config against
the first (TP=1), and throughput on the mixed workload of issue #5, for TP=1, TP=2 and DP=2.

  python benchmarks/bench_parallel.py --json /tmp/parallel.json   # suite: parallel (2 GPUs)
  python benchmarks/bench_parallel.py --tiny --device cpu --quick --executor multiproc  # CPU smoke (gloo)

A config is tp<N>, pp<N> and dp<N> run together: tp1, tp2, dp2, tp2pp2, dp2tp2, ... The first config is
the reference for the agreement columns. Agreement is measured two ways: free running (32 prompts, 64
greedy tokens; one early flip costs the rest of a sequence) and teacher forced (each step's greedy token on
the reference's own history). Random weights give nearly flat logits, and TP sums its partial products in
a different order than TP=1, so free-running bf16 outputs may part after a near-tie; teacher-forced
agreement shows whether each step's choice agrees.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_graphs import agreement, workloads  # noqa: E402
from common import print_table, write_json  # noqa: E402
from random_models import SHAPES, make_random_model  # noqa: E402

CHECK_PROMPTS, CHECK_NEW = 32, 64


def parse_config(name: str) -> dict[str, int]:
    """'tp2' -> {'tp': 2, 'pp': 1, 'dp': 1}; 'dp2tp2' -> {'tp': 2, 'pp': 1, 'dp': 2}."""
    parts = re.findall(r"(tp|pp|dp)(\d+)", name)
    if not parts or "".join(k + v for k, v in parts) != name or len({k for k, _ in parts}) != len(parts):
        raise ValueError(f"bad config {name!r}: use tp<N>, pp<N>, dp<N> (e.g. tp2, dp2tp2)")
    return {"tp": 1, "pp": 1, "dp": 1, **{k: int(v) for k, v in parts}}


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run(llm, reqs: list[tuple[int, int]], seed: int = 0) -> tuple[float, int, list[list[int]]]:
    """Greedy, EOS ignored: (wall seconds, prompt tokens, output token ids). Same prompts as bench_graphs."""
    from turnout import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(p)] for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t, sum(map(len, prompts)), [o.token_ids for o in outs]


def check_workload() -> list[tuple[int, int]]:
    rng = random.Random(1)
    return [(rng.randint(16, 700), CHECK_NEW) for _ in range(CHECK_PROMPTS)]


def teacher_forced(llm, reqs: list[tuple[int, int]], ref: list[list[int]], seed: int = 7) -> list[list[int]]:
    """The engine's greedy token after every prefix of the reference continuation (prefix caching makes
    this cheap); compared position by position with ref."""
    from turnout import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(p)] for p, _ in reqs]
    forced = [p + r[:i] for p, r in zip(prompts, ref) for i in range(len(r))]
    outs = llm.generate(forced, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    flat, out, i = [o.token_ids[0] for o in outs], [], 0
    for r in ref:
        out.append(flat[i : i + len(r)])
        i += len(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["tp1", "tp2", "dp2"], help="the first is the reference")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--model-dir", help="default /tmp/turnout-<shape> (/tmp/turnout-tiny-qwen3 with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tests/tiny_models' 2-layer qwen3 (CPU smoke runs)")
    ap.add_argument("--executor", default="auto", help="auto: uniproc for 1 rank, multiproc for more")
    ap.add_argument("--cudagraph-mode", help="a graph policy name; default: the engine's default")
    args, configs = parse_args(ap, parse_config)

    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
        from tiny_models import make_tiny_model

        path = make_tiny_model(Path(args.model_dir or "/tmp/turnout-tiny-qwen3"), "qwen3", num_kv_heads=2,
                               max_position_embeddings=4096)  # fmt: skip
        model = "tiny qwen3 (2 layers, hidden 64), random weights"
    else:
        path = make_random_model(Path(args.model_dir or f"/tmp/turnout-{args.shape}"), args.shape)
        model = f"{args.shape}-shaped, random bf16 weights"
    sizes = lambda c: dict(
        tensor_parallel_size=c["tp"], pipeline_parallel_size=c["pp"], data_parallel_size=c["dp"]
    )
    runs = [(name, sizes(c)) for name, c in zip(args.configs, configs)]
    describe = lambda llm: {"executor": llm.selection.executor.chosen.name}
    rows, extra = compare(path, runs, describe, None, args, model=model)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print_table([{k: r.get(k, "") for k in keys} for r in rows])
    write_json(args.json, rows, args, **extra)


def parse_args(
    ap: argparse.ArgumentParser, parse: Callable[[str], dict]
) -> tuple[argparse.Namespace, list[dict]]:
    """The options compare() reads, added to ap; then the parsed arguments and each --configs name parsed.
    With --device cpu, TURNOUT_DEVICE=cpu is set for this process and the workers it starts."""
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto", help="cpu: TURNOUT_DEVICE=cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--quick", action="store_true", help="mixed workload at 1/8: requests and output lengths")
    ap.add_argument("--skip-throughput", action="store_true", help="the agreement check alone")
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        configs = [parse(c) for c in args.configs]
    except ValueError as e:
        ap.error(str(e))
    if args.device == "cpu":
        os.environ["TURNOUT_DEVICE"] = "cpu"
    return args, configs


def compare(
    path: Path,
    runs: list[tuple[str, dict[str, Any]]],
    describe: Callable[[Any], dict],
    after: Callable[[Any], dict] | None,
    args: argparse.Namespace,
    model: str,
) -> tuple[list[dict], dict]:
    """Start each named config (LLM keyword arguments over the engine settings of args) in turn; check its
    greedy outputs against the first config's (free-running and teacher-forced) and, unless
    --skip-throughput, time the mixed workload. describe(llm) adds to a config's row at start-up and
    after(llm) once its workloads ran; a config that fails gets an error row. args.json is rewritten after
    each config. Returns the rows and the file's extra fields."""
    from turnout import LLM
    from turnout.errors import TurnoutError

    engine_kw = dict(dtype=args.dtype, executor=args.executor, attention_backend=args.attention_backend,
                     max_num_seqs=256, max_num_batched_tokens=2048,
                     gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    if getattr(args, "cudagraph_mode", None):
        engine_kw["cudagraph_mode"] = args.cudagraph_mode
    check, mixed = check_workload(), workloads(args.quick)["mixed"]
    scale = 8 if args.quick else 1
    extra = dict(model=model, engine=engine_kw, quick=args.quick, reference=None,
                 check=f"{CHECK_PROMPTS} prompts of 16..700 tokens, {CHECK_NEW} greedy tokens",
                 mixed=f"{len(mixed)} requests, prompt 100..1024, output 100..1024 // {scale}")  # fmt: skip
    if args.device == "cpu":
        extra["device"] = "cpu (TURNOUT_DEVICE=cpu)"
    rows, ref = [], None
    for name, kw in runs:
        row: dict = {"config": name}
        t0 = time.perf_counter()
        try:
            llm = LLM(str(path), **kw, **engine_kw)
        except (TurnoutError, RuntimeError) as e:
            print(f"{name}: did not start: {str(e).splitlines()[0]}", flush=True)
            rows.append({**row, "error": str(e).splitlines()[0]})
            continue
        try:
            sel = llm.selection
            row.update(describe(llm), attention=sel.attention.chosen.name, graph=sel.effective_graph.name,
                       startup_s=time.perf_counter() - t0)  # fmt: skip
            _, _, outs = run(llm, check, seed=7)  # also the warm-up before the timed workload
            if ref is None:
                ref, extra["reference"] = outs, name
            tok, same = agreement(outs, ref)
            row.update(tok_agree=tok, seqs_identical=f"{same}/{len(ref)}",
                       tf_agree=agreement(teacher_forced(llm, check, ref), ref)[0])  # fmt: skip
            if not args.skip_throughput:
                dt, prompt_toks, outs = run(llm, mixed)
                out_toks = sum(map(len, outs))
                row.update(mixed_out_tok_s=out_toks / dt, mixed_total_tok_s=(out_toks + prompt_toks) / dt,
                           mixed_wall_s=dt)  # fmt: skip
            row.update(after(llm) if after else {})
        except (TurnoutError, RuntimeError) as e:
            print(f"{name}: failed: {str(e).splitlines()[0]}", flush=True)
            row["error"] = str(e).splitlines()[0]
        finally:  # the next config gets the GPUs back: worker processes end, in-process weights are freed
            llm.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # an in-process engine ran here
                torch.cuda.empty_cache()
                row["driver_gib_left"] = left = torch.cuda.memory_reserved() / 2**30
                if left > 0.25:  # the next config's rank 0 would count it as used by another process
                    print(f"{name}: this process still holds {left:.2f} GiB of GPU memory", flush=True)
        rows.append(row)
        print(row, flush=True)
        write_json(args.json, rows, args, **extra)
    return rows, extra


if __name__ == "__main__":
    main()
