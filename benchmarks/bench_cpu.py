"""The embedded SmolLM2-135M-Instruct on the CPU against HF transformers, in one process.

Both engines get the same tokens, and their repeats alternate.

  throughput  turnout's generate against HF `generate`, greedy, every request exactly --output-len new
              tokens, each dtype in both engines; the median of the repeats          (suite: cpu-vs-hf)
  ttft        time to first token: turnout's generate of one prompt with max_tokens=1 against HF's one
              forward of the same tokens (bf16, fp32). Every run has a prompt of its own, so no run hits
              the prefix cache; the first run at each length (new shapes) is kept apart from the median
              of the others                                                          (suite: cpu-latency)

  python benchmarks/bench_cpu.py throughput --batch 1 16 --output-len 64 --json /tmp/cpu.json
  python benchmarks/bench_cpu.py ttft --input-len 512 2048 4096 --json /tmp/ttft.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized at load)"
TOPICS = ["rivers", "trains", "bread", "stars", "music", "chess", "rain", "cats", "tea", "maps", "glass",
          "bees", "salt", "clocks", "paper", "bridges"]  # fmt: skip


def hf_model(dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    from turnout.loader.default_model import default_gguf_path

    gguf = default_gguf_path()  # transformers reads the GGUF itself: the cached folder holds no weights
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    ).eval()


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a shared machine the second moves less."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


# ---- throughput ----
def prompts(tok, n: int) -> list[str]:
    msgs = [
        [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} in detail."}] for i in range(n)
    ]
    return [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]


def turnout_tok_s(llm, texts: list[str], out_len: int) -> float:
    from turnout import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(texts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == out_len for o in outs)
    return len(texts) * out_len / dt


def hf_tok_s(model, tok, texts: list[str], out_len: int) -> float:
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    t = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(**batch, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
    dt = time.perf_counter() - t
    assert gen.shape[1] - batch.input_ids.shape[1] == out_len
    return len(texts) * out_len / dt


def throughput(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from transformers import AutoTokenizer

    from turnout import LLM
    from turnout.loader.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for dtype in args.dtype:
        llm, hf = LLM(str(path), dtype=dtype), hf_model(dtype)
        for b in args.batch:
            texts = prompts(tok, b)
            turnout_tok_s(llm, texts[:1], 4)  # warm-up
            runs = [(turnout_tok_s(llm, texts, args.output_len), hf_tok_s(hf, tok, texts, args.output_len))
                    for _ in range(args.repeats)]  # fmt: skip
            ours, theirs = (statistics.median(r) for r in zip(*runs))
            rows.append({"dtype": dtype, "batch": b, "turnout_tok_s": ours, "hf_tok_s": theirs,
                         "speedup": ours / theirs})  # fmt: skip
        llm.shutdown()
        del llm, hf
    by = {(r["dtype"], r["batch"]): r for r in rows}
    for b in args.batch:  # turnout's default ("auto": bf16 on CPUs with native bf16) against HF's float32
        if ("bfloat16", b) in by and ("float32", b) in by:
            ours, theirs = by[("bfloat16", b)]["turnout_tok_s"], by[("float32", b)]["hf_tok_s"]
            rows.append({"dtype": "bf16 vs HF fp32", "batch": b, "turnout_tok_s": ours, "hf_tok_s": theirs,
                         "speedup": ours / theirs})  # fmt: skip
    return rows, {}


# ---- time to first token ----
def ttft(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from turnout import LLM, SamplingParams

    llm = LLM(dtype=args.dtype)
    hf = {d: hf_model(d) for d in args.hf_dtype}
    sp = SamplingParams(temperature=0, max_tokens=1)
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(hf.values())).config.vocab_size

    def turnout_run(ids: list[int]) -> None:
        out = llm.generate([ids], sp, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 1 and out.num_cached_tokens == 0

    @torch.no_grad()
    def hf_run(model, ids: list[int]) -> None:
        model(torch.tensor([ids]), use_cache=False)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    turnout_run(prompt(64)), [hf_run(m, prompt(64)) for m in hf.values()]  # warm-up
    engines = {"turnout": turnout_run, **{f"hf_{d}": lambda ids, m=m: hf_run(m, ids) for d, m in hf.items()}}
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.repeats + 1):
        for n in args.input_len:
            for name, run in engines.items():
                runs.setdefault(f"{n} {name}", []).append(timed(lambda ids=prompt(n), run=run: run(ids)))
            print(n, {k.split()[1]: round(v[-1][0], 2) for k, v in runs.items() if k.startswith(f"{n} ")},
                  file=sys.stderr)  # fmt: skip
    rows = []
    for n in args.input_len:
        row: dict[str, Any] = {"input_len": n}
        for name in engines:
            (first, _), rest = runs[f"{n} {name}"][0], runs[f"{n} {name}"][1:]
            row[f"{name}_first_s"] = first
            row[f"{name}_ttft_s"] = statistics.median(w for w, _ in rest)
            row[f"{name}_cpu_s"] = statistics.median(c for _, c in rest)
        if "hf_bfloat16" in engines:
            row["hf_bf16_over_turnout"] = row["hf_bfloat16_ttft_s"] / row["turnout_ttft_s"]
        rows.append(row)
    extra = {"selection": llm.engine.selection.summary(), "runs_wall_cpu_s": runs}
    llm.shutdown()
    return rows, extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    tp = sub.add_parser("throughput", help="tokens/s of generate, by batch and dtype")
    tp.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    tp.add_argument("--output-len", type=int, default=64)
    tp.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="run both engines in each")
    tt = sub.add_parser("ttft", help="time to first token, by prompt length")
    tt.add_argument("--input-len", type=int, nargs="+", default=[512, 2048, 4096])
    tt.add_argument("--dtype", default="auto", help="turnout's dtype (auto = bf16 on CPUs with native bf16)")
    tt.add_argument("--hf-dtype", nargs="+", default=["bfloat16", "float32"])
    for p in (tp, tt):
        p.add_argument("--repeats", type=int, default=3, help="runs per engine (ttft: after a first one)")
        p.add_argument("--json")
    args = ap.parse_args()
    rows, extra = (throughput if args.mode == "throughput" else ttft)(args)
    print_table(rows)
    write_json(args.json, rows, args, model=MODEL, threads=torch.get_num_threads(), **extra)


if __name__ == "__main__":
    main()
