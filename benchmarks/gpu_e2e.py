"""End to end on the GPU: bf16 Qwen3- and Llama-shaped models, 32 prompts, 64 greedy tokens. Every
installed GPU attention backend against each other and against HF transformers (bf16, same GPU).

  python benchmarks/gpu_e2e.py --json /tmp/e2e.json   # suite: e2e
  python benchmarks/gpu_e2e.py --shapes smollm2-135m --gguf SmolLM2-135M-Instruct.Q4_1.gguf  # real weights

The shapes in random_models.py carry random weights (no downloads on the GPU machine). `smollm2-135m` is
the embedded default model's real weights, converted from its GGUF by turnout's loader, with 32 English
prompts: trained logits have clear winners, so free-running agreement measures the backends, not ties.
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
REAL_PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system",
    "Photosynthesis is the process by which", "In 1969, the first humans", "A healthy breakfast includes",
    "The main causes of the French Revolution were", "To bake bread, you first", "Python is a programming",
    "The theory of relativity states that", "Once upon a time, in a small village,", "The heart pumps blood",
    "Machine learning models learn from", "The Great Wall of China was built", "Rain forms when water vapour",
    "The three primary colours are", "A good night's sleep helps", "Shakespeare wrote plays such as",
    "The speed of light in a vacuum is", "To stay safe while cycling, always",
    "The Amazon river flows through",
    "An atom consists of", "The stock market is a place where", "Volcanoes erupt because",
    "My favourite season is autumn because", "The recipe for pancakes calls for",
    "Bees are important because",
    "The internet was invented to", "Mount Everest is located in", "Exercise improves health by",
    "The moon orbits the Earth every", "Vaccines protect people by",
]  # fmt: skip


def hf_model(path: Path, device: str = "cuda"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()


def hf_greedy(model, batches: list[list[list[int]]], device: str = "cuda") -> list[list[int]]:
    """HF transformers' greedy continuations, each batch of prompts left-padded. A plain argmax loop
    over the model's forward and its KV cache, not generate(): generate's min_new_tokens would mask EOS,
    while the engine's ignore_eos only keeps going, so the two would choose differently where EOS wins."""
    return [seq for prompts in batches for seq in _greedy(model, prompts, device)]


def hf_teacher_forced(model, prompts: list[list[int]], ref: list[list[int]], device: str = "cuda"):
    """HF alone (no padding) on each reference history: one causal forward over prompt + ref gives the
    greedy choice after every prefix. Against a batched HF reference, this is bf16's own noise floor."""
    outs = []
    with torch.no_grad():
        for p, r in zip(prompts, ref):
            logits = model(input_ids=torch.tensor([p + r[:-1]], device=device)).logits[0]  # [len, V]
            outs.append(logits[len(p) - 1 :].argmax(-1).tolist())
    return outs


def _greedy(model, prompts: list[list[int]], device: str) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, width]: each prompt starts at position 0
    new: list[torch.Tensor] = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for _ in range(NEW):
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            new.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token, attention_mask=mask, position_ids=positions,
                        past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
    return torch.cat(new, dim=1).tolist()


def agree(a: list[list[int]], b: list[list[int]], upto: list[int] | None = None) -> float:
    """Free-running agreement: position by position, so one early flip costs the rest of the sequence.
    upto[i]: compare only sequence i's first upto[i] positions."""
    upto = upto or [len(s) for s in a]
    same = sum(x == y for sa, sb, n in zip(a, b, upto) for x, y in zip(sa[:n], sb[:n]))
    return same / max(1, sum(upto))


def first_eos(ref: list[list[int]], eos: set[int]) -> list[int]:
    """Positions before the reference's first EOS: past it, ignore_eos text has no trained winner."""
    return [next((i for i, t in enumerate(r) if t in eos), len(r)) for r in ref]


def teacher_forced(llm, prompts: list[list[int]], ref: list[list[int]]) -> list[list[int]]:
    """The engine's greedy token after every prefix of HF's continuation: prompt + ref[:i] for each i.
    Random-weight logits are nearly flat, so free-running greedy drifts apart after any near-tie; this
    compares each step's choice on the same history (prefix caching makes it cheap)."""
    from turnout import SamplingParams

    forced = [p + r[:i] for p, r in zip(prompts, ref) for i in range(len(r))]
    outs = llm.generate(forced, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    flat = [o.token_ids[0] for o in outs]
    return [flat[i * NEW : (i + 1) * NEW] for i in range(len(prompts))]


def alone_vs_hf(llm, model, prompts: list[list[int]], device: str = "cuda") -> dict[str, float]:
    """Batch-1 decode (every step a one-token batch: the GEMV path of layers/gemv.py): each prompt alone,
    greedy with logprobs; then HF's one forward over prompt + that output scores the same history. Returns
    how often HF's argmax is the engine's token and the largest gap between the two chosen-token logprobs."""
    from turnout import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    same = total = 0
    gap = 0.0
    for p in prompts:
        out = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + out.token_ids[:-1]], device=device)).logits[0]
        hf = torch.log_softmax(logits[len(p) - 1 :].float(), -1)  # [NEW, V]
        ids = torch.tensor(out.token_ids, device=device)
        same += int((hf.argmax(-1) == ids).sum())
        total += len(ids)
        chosen = hf.gather(1, ids[:, None])[:, 0].cpu()
        ours = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])
        gap = max(gap, float((chosen - ours).abs().max()))
    return {"alone_hf_agrees": same / max(1, total), "alone_logprob_max_gap": gap}


def model_and_prompts(
    shape: str, gguf: Path | None, random_prompts: list[list[int]]
) -> tuple[Path, list[list[int]]]:
    if shape != "smollm2-135m":
        return make_random_model(Path(f"/tmp/turnout-{shape}"), shape), random_prompts
    from transformers import AutoTokenizer

    from turnout.loader.gguf import convert_gguf

    if gguf is None:
        sys.exit("smollm2-135m needs --gguf PATH (the embedded model's SmolLM2-135M-Instruct.Q4_1.gguf)")
    path = Path("/tmp/turnout-smollm2-135m")
    if not (path / "config.json").exists():
        convert_gguf(gguf, path)
    tok = AutoTokenizer.from_pretrained(path)
    return path, [tok(p)["input_ids"] for p in REAL_PROMPTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-360m"], help="or smollm2-135m")
    ap.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf, for the smollm2-135m shape")
    ap.add_argument("--backends", nargs="+", default=["flash_attn", "flashinfer", "triton"])
    ap.add_argument("--hf-self", action="store_true", help="HF unbatched vs batched: bf16's noise floor")
    ap.add_argument("--alone", type=int, default=0, help="also decode this many prompts one at a time")
    ap.add_argument("--json")
    args = ap.parse_args()
    from turnout import LLM, SamplingParams
    from turnout.errors import SelectionError

    rng = random.Random(0)
    random_prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 256))] for _ in range(32)]
    rows, sequences = [], {}
    for shape in args.shapes:
        path, prompts = model_and_prompts(shape, args.gguf, random_prompts)
        model = hf_model(path)
        ref = hf_greedy(model, [prompts])
        eos = {model.config.eos_token_id} if isinstance(model.config.eos_token_id, int) else set()
        upto = first_eos(ref, eos)
        if args.hf_self:
            alone = hf_greedy(model, [[p] for p in prompts])
            row = {"model": shape, "backend": "hf, one at a time", "vs_hf": agree(alone, ref),
                   "vs_hf_before_eos": agree(alone, ref, upto),
                   "vs_hf_teacher_forced": agree(hf_teacher_forced(model, prompts, ref), ref),
                   # HF's one forward over its own greedy text against its cached decode of that text
                   "own_history_teacher_forced": agree(hf_teacher_forced(model, prompts, alone), alone),
                   }  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        if not args.alone:
            del model
        sequences[shape] = {"hf": ref}
        outs: dict[str, list[list[int]]] = {}
        for b in args.backends:
            try:
                llm = LLM(str(path), attention_backend=b, gpu_memory_utilization=0.5)
                sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
                outs[b] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
                forced = teacher_forced(llm, prompts, ref)
                solo = alone_vs_hf(llm, model, prompts[: args.alone]) if args.alone else {}
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
                   "vs_hf_before_eos": agree(outs[b], ref, upto),
                   "vs_hf_teacher_forced": agree(forced, ref), **solo}  # fmt: skip
            sequences[shape][b] = outs[b]
            for other in outs:
                if other != b:
                    row[f"vs_{other}"] = agree(outs[b], outs[other])
            rows.append(row)
            print(row, flush=True)
            write_json(args.json, rows, args, prompts=32, new_tokens=NEW, dtype="bfloat16",
                       shapes=args.shapes, sequences=sequences)  # fmt: skip
    keys = sorted({k for r in rows for k in r}, key=str)
    print_table([{k: r.get(k, "") for k in keys} for r in rows])
    write_json(args.json, rows, args, prompts=32, new_tokens=NEW, dtype="bfloat16", shapes=args.shapes,
               sequences=sequences)  # fmt: skip


if __name__ == "__main__":
    main()
