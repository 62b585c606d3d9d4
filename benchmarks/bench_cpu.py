"""CPU throughput on the embedded SmolLM2-135M-Instruct: turnout vs HF transformers `generate`, same
prompts, same machine, one run, interleaved repeats (median). Greedy; every request generates exactly
--output-len tokens; each dtype runs in both engines.

  python benchmarks/bench_cpu.py --batch 1 16 --output-len 64 --json /tmp/cpu.json   # suite: cpu-vs-hf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402

TOPICS = ["rivers", "trains", "bread", "stars", "music", "chess", "rain", "cats", "tea", "maps", "glass",
          "bees", "salt", "clocks", "paper", "bridges"]  # fmt: skip


def prompts(tok, n: int) -> list[str]:
    msgs = [
        [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} in detail."}] for i in range(n)
    ]
    return [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]


def bench_turnout(llm, texts: list[str], out_len: int) -> float:
    from turnout import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(texts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == out_len for o in outs)
    return len(texts) * out_len / dt


def bench_hf(model, tok, texts: list[str], out_len: int) -> float:
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    t = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(**batch, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
    dt = time.perf_counter() - t
    assert gen.shape[1] - batch.input_ids.shape[1] == out_len
    return len(texts) * out_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="run both engines in each")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per engine; the median counts")
    ap.add_argument("--json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnout import LLM
    from turnout.loader.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for dtype in args.dtype:
        llm = LLM(str(path), dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        for b in args.batch:
            texts = prompts(tok, b)
            bench_turnout(llm, texts[:1], 4)  # warm-up
            runs = [(bench_turnout(llm, texts, args.output_len), bench_hf(hf, tok, texts, args.output_len))
                    for _ in range(args.repeats)]  # fmt: skip
            ours, theirs = (statistics.median(r) for r in zip(*runs))
            rows.append(
                {
                    "dtype": dtype,
                    "batch": b,
                    "turnout_tok_s": ours,
                    "hf_tok_s": theirs,
                    "speedup": ours / theirs,
                }
            )
        llm.shutdown()
        del llm, hf
    by = {(r["dtype"], r["batch"]): r for r in rows}
    for b in args.batch:  # turnout's default ("auto": bf16 on CPUs with native bf16) against HF's float32
        if ("bfloat16", b) in by and ("float32", b) in by:
            ours, theirs = by[("bfloat16", b)]["turnout_tok_s"], by[("float32", b)]["hf_tok_s"]
            rows.append({"dtype": "bf16 vs HF fp32", "batch": b, "turnout_tok_s": ours, "hf_tok_s": theirs,
                         "speedup": ours / theirs})  # fmt: skip
    print_table(rows)
    write_json(
        args.json,
        rows,
        args,
        model="SmolLM2-135M-Instruct (Q4_1 GGUF -> bfloat16)",
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
