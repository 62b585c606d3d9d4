"""Host work of a decode step at a large batch, on the CPU: a tiny random model keeps the forward small, so
the engine's own Python shows (scheduler, input preparation, sampler, update).

  python benchmarks/profile_host.py --batch 256 --steps 64 [--temperature 0.6] [--async-scheduling] [--json F]

Prints ms per decode step, each the best of --repeats passes: LLMEngine.step, and the hot functions inside
it, timed by wrappers. "outside forward" is the step less the model forward and the logits (on a GPU that
share runs on the device). Times are this thread's CPU time, with torch on one thread, so other processes on
a shared machine barely move them. Timing starts once every request decodes. --cprofile prints cProfile's
top functions by own time instead, to find what to cut.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import importlib
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402

from tiny_models import make_tiny_model  # noqa: E402

HOT = {  # label -> (module, class, method or methods: the first one the class defines)
    "step": ("turnout.engine.llm_engine", "LLMEngine", "step"),
    "schedule": ("turnout.engine.scheduler", "Scheduler", "schedule"),
    "prepare": ("turnout.worker.model_runner", "ModelRunner", "prepare"),
    "forward": ("turnout.worker.model_runner", "ModelRunner", "_forward"),
    "sampler": ("turnout.worker.sampler", "Sampler", ("forward", "__call__")),
    "update": ("turnout.engine.scheduler", "Scheduler", "update"),
    "detokenize": ("turnout.engine.llm_engine", "LLMEngine", "_detokenize"),
    "launch": ("turnout.engine.llm_engine", "LLMEngine", "_launch"),
    "read": ("turnout.engine.llm_engine", "LLMEngine", "_read"),
    "execute": ("turnout.worker.model_runner", "ModelRunner", "execute_model"),
    "fill": ("turnout.worker.model_runner", "ModelRunner", "_fill_placeholders"),
    "get": ("turnout.worker.model_runner", "AsyncModelRunnerOutput", "get"),
}
spent: dict[str, float] = defaultdict(float)


def timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.thread_time() - t

    return wrapper


def time_gc(phase: str, info: dict, started: list[float] = []) -> None:  # noqa: B006 (the timer's state)
    if phase == "start":
        started.append(time.thread_time())
    elif started:
        spent["gc"] += time.thread_time() - started.pop()


def instrument(model_cls: type) -> None:
    for label, (module, cls, names) in HOT.items():
        owner = getattr(importlib.import_module(module), cls, None)
        for name in [names] if isinstance(names, str) else names:
            if owner is not None and name in vars(owner):
                setattr(owner, name, timed(label, vars(owner)[name]))
                break
    model_cls.compute_logits = timed("logits", model_cls.compute_logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--json", help="also write the times here")
    args = ap.parse_args()

    import torch

    from turnout import LLM, SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(Path(d), "llama", max_position_embeddings=4096)
        max_tokens = (args.repeats + 1) * args.steps + 8
        llm = LLM(
            str(path), attention_backend="cpu", max_num_seqs=args.batch, max_model_len=4096,
            max_num_batched_tokens=args.batch * args.prompt_len,
            **({"async_scheduling": True} if args.async_scheduling else {}),
        )  # fmt: skip
        engine = llm.engine
        sp = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request([(i * 31 + j * 7) % 500 + 3 for j in range(args.prompt_len)], sp)
        for _ in range(4):  # the prefill, then decodes only
            engine.step()
        if args.cprofile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [engine.step() for _ in range(args.steps)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        instrument(type(engine.executor.worker.runner.model))
        gc.callbacks.append(time_gc)
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            spent.clear()
            for _ in range(args.steps):
                engine.step()
            for k, v in spent.items():
                best[k] = min(best.get(k, float("inf")), v / args.steps * 1e3)
        llm.shutdown()
    mode = "async" if args.async_scheduling else "sync"
    print(f"batch {args.batch}, temperature {args.temperature}, {mode} (ms/step, thread CPU time):")
    print("  " + ", ".join(f"{k} {best.get(k, 0):.3f}" for k in [*HOT, "logits", "gc"]))
    outside = best["step"] - best.get("forward", 0) - best.get("logits", 0)
    print(f"  outside forward {outside:.3f}")
    row = {"mode": mode, **{f"{k}_ms": round(best.get(k, 0), 4) for k in [*HOT, "logits", "gc"]}}
    write_json(args.json, [{**row, "outside_forward_ms": round(outside, 4)}], args)


if __name__ == "__main__":
    main()
