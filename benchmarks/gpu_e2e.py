"""End to end on the GPU: bf16 Qwen3- and Llama-shaped models, 32 prompts, 64 greedy tokens. Every
installed GPU attention backend against each other and against HF transformers (bf16, same GPU).

  python benchmarks/gpu_e2e.py --json benchmarks/results/gpu_e2e.json
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402
from random_models import make_random_model  # noqa: E402

NEW = 64


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers' greedy continuations, all prompts in one left-padded batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    del model
    return gen[:, width:].tolist()


def agree(a: list[list[int]], b: list[list[int]]) -> float:
    """Free-running agreement: position by position, so one early flip costs the rest of the sequence."""
    return sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb)) / sum(len(s) for s in a)


def teacher_forced(llm, prompts: list[list[int]], ref: list[list[int]]) -> list[list[int]]:
    """The engine's greedy token after every prefix of HF's continuation: prompt + ref[:i] for each i.
    Random-weight logits are nearly flat, so free-running greedy drifts apart after any near-tie; this
    compares each step's choice on the same history (prefix caching makes it cheap)."""
    from turnout import SamplingParams

    forced = [p + r[:i] for p, r in zip(prompts, ref) for i in range(len(r))]
    outs = llm.generate(forced, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    flat = [o.token_ids[0] for o in outs]
    return [flat[i * NEW : (i + 1) * NEW] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-360m"])
    ap.add_argument("--backends", nargs="+", default=["flash_attn", "flashinfer", "triton"])
    ap.add_argument("--json")
    args = ap.parse_args()
    from turnout import LLM, SamplingParams
    from turnout.errors import SelectionError

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 256))] for _ in range(32)]
    rows = []
    for shape in args.shapes:
        path = make_random_model(Path(f"/tmp/turnout-{shape}"), shape)
        ref = hf_greedy(path, prompts)
        outs: dict[str, list[list[int]]] = {}
        for b in args.backends:
            try:
                llm = LLM(str(path), attention_backend=b, gpu_memory_utilization=0.5)
                sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
                outs[b] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
                forced = teacher_forced(llm, prompts, ref)
            except (SelectionError, RuntimeError) as e:
                print(f"{shape} {b}: failed: {str(e).splitlines()[0]}")
                rows.append({"model": shape, "backend": b, "error": str(e).splitlines()[0]})
                continue
            mode = llm.selection.effective_graph.name
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
            row = {"model": shape, "backend": b, "graph_mode": mode, "vs_hf": agree(outs[b], ref),
                   "vs_hf_teacher_forced": agree(forced, ref)}  # fmt: skip
            for other in outs:
                if other != b:
                    row[f"vs_{other}"] = agree(outs[b], outs[other])
            rows.append(row)
            print(row, flush=True)
    keys = sorted({k for r in rows for k in r}, key=str)
    print_table([{k: r.get(k, "") for k in keys} for r in rows])
    write_json(args.json, rows, prompts=32, new_tokens=NEW, dtype="bfloat16")


if __name__ == "__main__":
    main()
