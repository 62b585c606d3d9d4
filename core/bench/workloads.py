"""The bench workloads as request lists, and the timed turnout runs over them."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from turnout.errors import TurnoutError


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.6
    ignore_eos: bool = True


def throughput(num_prompts: int = 256, max_input_len: int = 1024, max_output_len: int = 1024) -> list[Req]:
    """nano-vllm's bench.py: after random.seed(0), all prompts (length first, then ids in [0, 10000]), then
    all output lengths, each uniform in [100, max]. Up to 256 requests: the first of nano-vllm's 256; more
    are drawn the same way, in one longer run of that order."""
    rng = random.Random(0)
    lo_in, lo_out = min(100, max_input_len), min(100, max_output_len)
    n = max(256, num_prompts)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo_in, max_input_len))] for _ in range(n)]
    outs = [rng.randint(lo_out, max_output_len) for _ in range(n)]
    return [Req(p, o) for p, o in zip(prompts[:num_prompts], outs[:num_prompts])]


def subset(reqs: list[Req], n: int, output_len: int) -> list[Req]:
    """The first n requests, greedy, every one generating output_len tokens: what static batching can run."""
    return [Req(r.prompt, output_len, temperature=0.0) for r in reqs[:n]]


def prefix(
    num_prompts: int = 256, prefix_len: int = 2000, suffix_len: int = 32, output_len: int = 32, seed: int = 0
) -> list[Req]:
    """num_prompts requests that share one random prefix, each with its own random suffix."""
    rng = random.Random(seed)
    shared = [rng.randint(0, 10000) for _ in range(prefix_len)]
    return [
        Req(shared + [rng.randint(0, 10000) for _ in range(suffix_len)], output_len, 0.0)
        for _ in range(num_prompts)
    ]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(0, 10000) for _ in range(n)]


def from_jsonl(
    path: str | Path, tokenizer: Any, max_tokens: int, tokenizer_problem: str = "none was loaded"
) -> list[Req]:
    """One JSON object per line: "prompt" (text, or a list of token ids), optional "max_tokens". Token ids
    need no tokenizer (None); a text prompt without one is a TurnoutError naming its line and
    tokenizer_problem (why there is none, and the fix)."""
    reqs = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise TurnoutError(
            f'--input {path}: {e.strerror}; pass a JSONL file of {{"prompt": ...}} lines'
        ) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TurnoutError(
                f'{path}:{n} needs a JSON object with a "prompt" (text or token ids)'
            ) from None
        if isinstance(prompt, str) and tokenizer is None:
            raise TurnoutError(f"{path}:{n}: text prompts need a tokenizer, but {tokenizer_problem}")
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        reqs.append(Req(ids, int(row.get("max_tokens", max_tokens))))
    if not reqs:
        raise TurnoutError(f"--input {path} holds no prompts")
    return reqs


def as_json(reqs: list[Req]) -> list[dict[str, Any]]:
    return [asdict(r) for r in reqs]


def shapes(reqs: list[Req], cached: int = 0) -> list[tuple[int, int, int]]:
    """(prompt_len, cached_len, output_len) per request, for the roofline."""
    return [(len(r.prompt), min(cached, len(r.prompt) - 1), r.max_tokens) for r in reqs]


# ---- timed turnout runs ----
def run(llm: Any, reqs: list[Req]) -> tuple[float, int]:
    """Seconds for llm.generate over reqs, and the output tokens it produced."""
    from turnout import SamplingParams

    params = [
        SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
        for r in reqs
    ]
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    if bad := [o.error for o in outs if o.error]:
        raise TurnoutError(f"{len(bad)} bench requests were rejected: {bad[0]}")
    return seconds, sum(len(o.token_ids) for o in outs)


def warm_up(llm: Any) -> None:
    """nano-vllm's warm-up: one text prompt (token ids where llm has no tokenizer), temperature 1, 64
    tokens."""
    from turnout import SamplingParams

    prompt = "Benchmark: " if llm.get_tokenizer() is not None else [1, 2, 3, 4]
    llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)


def tpot_ms(llm: Any, tokens: int, prompt: list[int]) -> float:
    """Batch-1 decode time per token: (time for 1 + tokens outputs - time for 1 output) / tokens, over one
    prompt (nanobench.py's MODE=tpot uses 32 tokens)."""
    t_long, _ = run(llm, [Req(prompt, tokens + 1)])
    t_short, _ = run(llm, [Req(prompt, 1)])
    return (t_long - t_short) / tokens * 1e3


def ttft_ms(llm: Any, prompt: list[int]) -> float:
    """Time to the first token of one prompt, as a 1-token request; pass a fresh prompt for no cache hit."""
    seconds, _ = run(llm, [Req(prompt, 1)])
    return seconds * 1e3
