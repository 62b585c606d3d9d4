"""Is the GPU idle between decode steps? At a large batch, with async scheduling off and on: steady decode
steps under torch.profiler, the share of their window during which no kernel or copy runs on the device,
the longest gap, and (from an unprofiled pass) ms per step and output tok/s.

  python benchmarks/gpu_idle.py --model CKPT --batch 256 --steps 32 --json F

Without --model, a random Qwen3-0.6B-shaped checkpoint is made in --workdir. Prompts are --prompt-len
random tokens; sampling is nano-vllm's bench (temperature 0.6, ignore_eos).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402
from profile_decode import busy_us, kernel_spans  # noqa: E402
from random_models import make_random_model  # noqa: E402


def steady(engine, batch: int, prompt_len: int, steps: int) -> None:
    """batch requests, stepped until every one decodes."""
    from turnout import SamplingParams

    rng = random.Random(0)
    sp = SamplingParams(temperature=0.6, max_tokens=10 * steps + 64, ignore_eos=True)
    reqs = [engine.add_request([rng.randrange(10000) for _ in range(prompt_len)], sp) for _ in range(batch)]
    while min(len(r.output_token_ids) for r in reqs) < 2:
        engine.step()


def measure(model: str, on: bool, args: argparse.Namespace) -> dict:
    from turnout import LLM

    llm = LLM(model, async_scheduling=on, max_model_len=args.prompt_len + 10 * args.steps + 128)
    engine = llm.engine
    steady(engine, args.batch, args.prompt_len, args.steps)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    spans = sorted(kernel_spans(prof.events()), key=lambda s: s.start)
    window = spans[-1].end - spans[0].start
    gaps = [b.start - a.end for a, b in zip(spans, spans[1:])]
    llm.shutdown()
    return {
        "async_scheduling": on,
        "batch": args.batch,
        "ms_per_step": round(ms, 3),
        "output_tok_s": round(args.batch / ms * 1e3),
        "gpu_idle_pct": round(100 * (1 - busy_us(spans) / window), 2),
        "longest_gap_us": round(max(gaps, default=0.0), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--workdir", default="/tmp/turnout-gpu-idle")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model or str(make_random_model(Path(args.workdir) / "qwen3-0.6b", "qwen3-0.6b"))
    rows = [measure(model, on, args) for on in (False, True)]
    print_table(rows)
    write_json(args.json, rows, args)


if __name__ == "__main__":
    main()
