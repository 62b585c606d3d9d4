"""The bench workloads as request lists, and the timed turnout runs over them."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from turnout.errors import TurnoutError

# The structured workload's default: every field required and no string bounded, so outputs run long.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "text": {"type": "string"},
    },
    "required": ["id", "tags", "text"],
}


@dataclass(frozen=True)
class Req:
    """One bench request; json_schema, where set, holds its output to that schema."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.6
    ignore_eos: bool = True
    json_schema: dict[str, Any] | None = None


def throughput(num_prompts: int = 256, max_input_len: int = 1024, max_output_len: int = 1024) -> list[Req]:
    """nano-vllm's bench.py: after random.seed(0), all prompts (length first, then ids in [0, 10000]), then
    all output lengths, each uniform in [100, max]. Up to 256 requests: the first of nano-vllm's 256; more
    are drawn the same way, in one longer run of that order."""
    rng = random.Random(0)
    lo_in, lo_out = min(100, max_input_len), min(100, max_output_len)
    n = max(256, num_prompts)
    prompts = [random_ids(rng, rng.randint(lo_in, max_input_len)) for _ in range(n)]
    outs = [rng.randint(lo_out, max_output_len) for _ in range(n)]
    return [Req(p, o) for p, o in zip(prompts[:num_prompts], outs[:num_prompts])]


def wide(
    num_prompts: int = 1024, input_len: tuple[int, int] = (16, 64), output_len: tuple[int, int] = (256, 512)
) -> list[Req]:
    """Wide decode: num_prompts short prompts, each decoding a long output, so that most steps decode
    hundreds of requests at once. Per request after random.Random(0): the prompt's length, its ids in
    [0, 10000], then its output length; lengths uniform in their (shortest, longest) ranges, temperature
    0.6 and EOS ignored as in throughput."""
    rng = random.Random(0)
    return [
        Req(random_ids(rng, rng.randint(*input_len)), rng.randint(*output_len)) for _ in range(num_prompts)
    ]


def subset(reqs: list[Req], n: int, output_len: int) -> list[Req]:
    """The first n requests, greedy, every one generating output_len tokens: what static batching can run."""
    return [Req(r.prompt, output_len, temperature=0.0) for r in reqs[:n]]


def prefix(
    num_prompts: int = 256, prefix_len: int = 2000, suffix_len: int = 32, output_len: int = 32, seed: int = 0
) -> list[Req]:
    """num_prompts requests that share one random prefix, each with its own random suffix."""
    rng = random.Random(seed)
    shared = random_ids(rng, prefix_len)
    return [Req(shared + random_ids(rng, suffix_len), output_len, 0.0) for _ in range(num_prompts)]


def constrained_ids(n: int, ratio: float) -> list[int]:
    """The round(ratio * n) of n requests that a structured run constrains, spread evenly over them."""
    k = round(ratio * n)
    return [i * n // k for i in range(k)]


def structured(reqs: list[Req], schema: dict[str, Any], ratio: float) -> list[Req]:
    """reqs with constrained_ids(len(reqs), ratio) of them held to schema."""
    ids = set(constrained_ids(len(reqs), ratio))
    return [replace(r, json_schema=schema) if i in ids else r for i, r in enumerate(reqs)]


def same_lengths(reqs: list[Req], outs: list[Any]) -> list[Req]:
    """reqs unconstrained, each to the tokens its output holds: a constrained run's work without grammars
    (a grammar that completes ends its request before max_tokens)."""
    return [replace(r, max_tokens=len(o.token_ids), json_schema=None) for r, o in zip(reqs, outs)]


def json_schema(path: str | Path) -> dict[str, Any]:
    """The JSON Schema a file holds; TurnoutError naming the file where it cannot be read or is no object."""
    try:
        schema = json.loads(Path(path).read_text())
    except OSError as e:
        raise TurnoutError(f"--json-schema {path}: {e.strerror}; pass a JSON Schema file") from None
    except json.JSONDecodeError as e:
        raise TurnoutError(f"--json-schema {path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise TurnoutError(f"--json-schema {path} holds a {type(schema).__name__}, not a JSON Schema object")
    return schema


def random_ids(rng: random.Random, n: int, top: int = 10000) -> list[int]:
    """n token ids drawn uniform in [0, top]."""
    return [rng.randint(0, top) for _ in range(n)]


def random_prompt(n: int, seed: int) -> list[int]:
    return random_ids(random.Random(seed), n)


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
    """(prompt_len, cached_len, output_len) per request, for the roofline; cached: the prompt tokens a
    prefix cache can serve (at most all but the last, which must run to sample)."""
    return [(len(r.prompt), min(cached, len(r.prompt) - 1), r.max_tokens) for r in reqs]


# ---- timed turnout runs ----
def sync() -> None:
    """Waits for the current CUDA device's work, where there is one."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds of fn(*args) between two synchronisations, and what it returned."""
    sync()
    t = time.perf_counter()
    out = fn(*args)
    sync()
    return time.perf_counter() - t, out


def generate(llm: Any, reqs: list[Req]) -> tuple[float, list[Any]]:
    """Seconds for llm.generate over reqs, and its RequestOutputs in their order."""
    from turnout import SamplingParams
    from turnout.structured_outputs import StructuredOutputsParams

    held = [None if r.json_schema is None else StructuredOutputsParams(json=r.json_schema) for r in reqs]
    params = [
        SamplingParams(
            temperature=r.temperature, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, structured_outputs=so
        )
        for r, so in zip(reqs, held)
    ]
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    if bad := [o.error for o in outs if o.error]:
        raise TurnoutError(f"{len(bad)} bench requests were rejected: {bad[0]}")
    return seconds, outs


def run(llm: Any, reqs: list[Req]) -> tuple[float, int]:
    """Seconds for llm.generate over reqs, and the output tokens it produced."""
    seconds, outs = generate(llm, reqs)
    return seconds, sum(len(o.token_ids) for o in outs)


def structured_pair(llm: Any, reqs: list[Req]) -> tuple[tuple[float, list[Any]], tuple[float, list[Any]]]:
    """generate over reqs as given, then over same_lengths of them: the same work, unconstrained."""
    constrained = generate(llm, reqs)
    return constrained, generate(llm, same_lengths(reqs, constrained[1]))


def warm_up(llm: Any) -> None:
    """nano-vllm's warm-up: one text prompt (token ids where llm has no tokenizer), temperature 1, 64
    tokens."""
    from turnout import SamplingParams

    prompt = "Benchmark: " if llm.get_tokenizer() is not None else [1, 2, 3, 4]
    llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)


def selection(llm: Any) -> dict[str, Any]:
    """What selection chose for llm, as the bench records it: the components and the fitted settings a
    tuning record can change."""
    sel = llm.selection
    fitted = sel.apply(llm.config)
    chosen = {"attention": sel.attention.chosen.name, "graph_mode": sel.effective_graph.name,
              "executor": sel.executor.chosen.name, "dtype": str(sel.dtype).removeprefix("torch."),
              "async_scheduling": sel.async_scheduling}  # fmt: skip
    return chosen | {k: getattr(fitted, k) for k in ("block_size", "max_num_batched_tokens", "max_num_seqs")}


def latency(
    llm: Any, tpot_tokens: int, plan: dict[str, Any], seconds: Callable[[list[int], int], float] | None = None
) -> dict[str, dict[str, Any]]:
    """Per run of plan ({run: {"tpot_prompt", "ttft_prompts"}}), at batch 1: tpot_ms, the decode time per
    token ((time for 1 + n outputs - time for 1 output) / n, n = tpot_tokens, over one prompt; nanobench.py's
    MODE=tpot uses 32 tokens), and ttft_ms by prompt length, each prompt's time as a 1-token request (fresh
    prompts: no prefix-cache hit). seconds(prompt, max_tokens) times one request: llm's by default."""

    def ms(prompt: list[int], max_tokens: int) -> float:
        return 1e3 * (seconds(prompt, max_tokens) if seconds else run(llm, [Req(prompt, max_tokens)])[0])

    return {
        r: {
            "tpot_ms": (ms(p["tpot_prompt"], tpot_tokens + 1) - ms(p["tpot_prompt"], 1)) / tpot_tokens,
            "ttft_ms": {str(len(q)): ms(q, 1) for q in p["ttft_prompts"]},
        }
        for r, p in plan.items()
    }
