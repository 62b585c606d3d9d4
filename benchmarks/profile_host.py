"""Where each engine step's wall time goes, by the number of requests running: every stage of
turnout.bench.STAGES timed per step over `turnout bench wide`'s workload, first run and repeat.

  python benchmarks/profile_host.py --random-model qwen3-8b [--max-num-seqs 512] [--json F]
  python benchmarks/profile_host.py --num-prompts 256 --max-output-len 64   # a tiny Llama on the CPU

A row is the steps that began with that many requests running: their count, their seconds, and each stage's
ms a step (wall clock; a stage's time includes the stages it calls). With async scheduling, "get" is the
wait for the GPU's tokens: steps where it is near zero are bound by the host. Without --random-model the
model is a 2-layer Llama of hidden size 64 on the CPU, so the engine's own Python shows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from turnout.bench import SHAPES, STAGES, random_model, run, stages, table, warm_up, wide, write_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402

TIMED = [s for s in STAGES if s != "add_request"]  # the stages inside a step
VOCAB = 10240  # the wide workload's prompt ids lie in [0, 10000]


def tiny_llama(path: Path) -> Path:
    """A 2-layer Llama of hidden size 64 with random float32 weights and a word-level tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    write_tokenizer(path, VOCAB)
    return path


def traced(llm, reqs, width: int) -> tuple[float, int, list[dict]]:
    """Seconds and output tokens of one run over reqs, and a row per bucket of `width` running requests."""
    sched, steps, step = llm.engine.scheduler, [], {}

    @contextmanager
    def timer(name: str, args: tuple):
        nonlocal step
        if name == "step":
            step = {"running": len(sched.running)}
            steps.append(step)
        t = time.perf_counter()
        try:
            yield
        finally:
            step[name] = step.get(name, 0.0) + time.perf_counter() - t

    with stages(llm, timer, TIMED):
        seconds, tokens = run(llm, reqs)
    buckets = defaultdict(list)
    for s in steps:
        buckets[-(-s["running"] // width)].append(s)
    rows = []
    for b, xs in sorted(buckets.items()):
        running, spent = f"{(b - 1) * width + 1}-{b * width}" if b else "0", sum(x["step"] for x in xs)
        ms = {f"{n}_ms": round(1e3 * sum(x.get(n, 0.0) for x in xs) / len(xs), 2) for n in TIMED}
        rows.append({"running": running, "steps": len(xs), "seconds": round(spent, 3), **ms})
    return seconds, tokens, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-model", choices=list(SHAPES), help="default: a tiny Llama on the CPU")
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--min-output-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=128, help="running requests a row")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    from turnout import LLM

    with tempfile.TemporaryDirectory() as d:
        kw = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
        if args.random_model:
            llm = LLM(str(random_model(args.random_model)), skip_tokenizer_init=True, **kw)
        else:
            llm = LLM(str(tiny_llama(Path(d))), attention_backend="cpu", dtype="float32", **kw)
        warm_up(llm)
        reqs = wide(args.num_prompts, output_len=(args.min_output_len, args.max_output_len))
        out = []
        for label in ("first", "repeat"):
            seconds, tokens, rows = traced(llm, reqs, args.bucket)
            seqs = llm.engine.config.max_num_seqs
            print(f"{label}: {seconds:.2f} s, {tokens / seconds:,.0f} output tok/s, max_num_seqs {seqs}")
            print(table(rows))
            out.append({"run": label, "seconds": seconds, "output_tok_s": tokens / seconds, "rows": rows})
        write_json(args.json, out, args, max_num_seqs=seqs)
        llm.shutdown()


if __name__ == "__main__":
    main()
