"""CPU time to first token on the embedded SmolLM2-135M-Instruct: turnout's generate of one random prompt
with max_tokens=1 against HF transformers' one forward of the same tokens (bf16 and fp32). Every run has
its own prompt (no prefix-cache hits); repeats are interleaved and the median counts.

  python benchmarks/bench_cpu_latency.py --input-len 512 2048 4096 --json /tmp/ttft.json  # suite: cpu-latency
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


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--dtype", default="auto", help="turnout's dtype (auto = bf16 on CPUs with native bf16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from turnout import LLM, SamplingParams
    from turnout.loader.default_model import default_model_path

    path = default_model_path()
    llm = LLM(dtype=args.dtype)
    hf = {d: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, d)).eval()
          for d in ("bfloat16", "float32")}  # fmt: skip
    vocab = hf["float32"].config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=1)
    gen = torch.Generator().manual_seed(0)

    def turnout_run(ids: list[int]) -> None:
        assert len(llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids) == 1

    @torch.no_grad()
    def hf_run(model, ids: list[int]) -> None:
        model(torch.tensor([ids]), use_cache=False)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    turnout_run(prompt(64)), [hf_run(m, prompt(64)) for m in hf.values()]  # warm-up
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):
        for n in args.input_len:
            times.setdefault((n, "turnout"), []).append(timed(lambda ids=prompt(n): turnout_run(ids)))
            for d, m in hf.items():
                times.setdefault((n, f"hf_{d}"), []).append(timed(lambda m=m, ids=prompt(n): hf_run(m, ids)))
            print(n, {k: round(v[-1], 2) for (m, k), v in times.items() if m == n}, file=sys.stderr)
    rows = []
    for n in args.input_len:
        med = {k: statistics.median(times[(n, k)]) for k in ("turnout", "hf_bfloat16", "hf_float32")}
        rows.append({"input_len": n, **{f"{k}_ttft_s": v for k, v in med.items()},
                     "vs_hf_bf16": med["hf_bfloat16"] / med["turnout"]})  # fmt: skip
    print_table(rows)
    write_json(
        args.json,
        rows,
        args,
        model="SmolLM2-135M-Instruct (Q4_1 GGUF -> bfloat16)",
        selection=llm.engine.selection.summary(),
        threads=torch.get_num_threads(),
        runs={f"{n} {k}": v for (n, k), v in times.items()},
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
