"""Host work of a decode step at a large batch, on the CPU: a tiny random model keeps the forward small, so
the engine's own Python shows (scheduler, input preparation, sampler, update).

  python benchmarks/profile_host.py --batch 256 --steps 64 [--temperature 0.6] [--async-scheduling] [--json F]

Prints ms per decode step, each the best of REPEATS passes: every stage of turnout.bench.STAGES, timed
through turnout.bench.stages, and the garbage collector. "outside forward" is the step less the model
forward and the logits (on a GPU that share runs on the device). Times are this thread's CPU time, with
torch on one thread, so other processes on a shared machine barely move them; a stage's time includes the
stages it calls. Timing starts once every request decodes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from turnout.bench import STAGES, stages, write_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402

VOCAB, PROMPT_LEN, REPEATS = 512, 32, 3
spent: dict[str, float] = defaultdict(float)


@contextmanager
def clock(label: str):
    """Adds the block's thread CPU time to spent[label]."""
    t = time.thread_time()
    try:
        yield
    finally:
        spent[label] += time.thread_time() - t


def time_gc(phase: str, info: dict, started: list[float] = []) -> None:  # noqa: B006 (the timer's state)
    if phase == "start":
        started.append(time.thread_time())
    elif started:
        spent["gc"] += time.thread_time() - started.pop()


def tiny_llama(path: Path) -> Path:
    """A 2-layer Llama of hidden size 64 with random float32 weights and a word-level tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    write_tokenizer(path, VOCAB)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--json", help="also write the times here")
    args = ap.parse_args()

    import torch

    from turnout import LLM, SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(
            str(tiny_llama(Path(d))), attention_backend="cpu", dtype="float32", max_num_seqs=args.batch,
            max_model_len=4096, max_num_batched_tokens=args.batch * PROMPT_LEN,
            **({"async_scheduling": True} if args.async_scheduling else {}),
        )  # fmt: skip
        engine = llm.engine
        sp = SamplingParams(temperature=args.temperature, max_tokens=(REPEATS + 1) * args.steps + 8,
                            ignore_eos=True)  # fmt: skip
        for i in range(args.batch):
            engine.add_request([(i * 31 + j * 7) % (VOCAB - 3) + 3 for j in range(PROMPT_LEN)], sp)
        for _ in range(4):  # the prefill, then decodes only
            engine.step()
        best: dict[str, float] = {}
        gc.callbacks.append(time_gc)
        with stages(llm, lambda name, call_args: clock(name)):
            for _ in range(REPEATS):
                spent.clear()
                for _ in range(args.steps):
                    engine.step()
                for k, v in spent.items():
                    best[k] = min(best.get(k, float("inf")), v / args.steps * 1e3)
        gc.callbacks.remove(time_gc)
        llm.shutdown()
    mode = "async" if args.async_scheduling else "sync"
    labels = [*STAGES, "gc"]
    print(f"batch {args.batch}, temperature {args.temperature}, {mode} (ms/step, thread CPU time):")
    print("  " + ", ".join(f"{k} {best.get(k, 0):.3f}" for k in labels))
    outside = best["step"] - best.get("forward", 0) - best.get("logits", 0)
    print(f"  outside forward {outside:.3f}")
    row = {"mode": mode, **{f"{k}_ms": round(best.get(k, 0), 4) for k in labels}}
    write_json(args.json, [{**row, "outside_forward_ms": round(outside, 4)}], args)


if __name__ == "__main__":
    main()
