"""The short fixed workloads `turnout tune` measures. Every round draws its prompts afresh from its seed,
the same for every candidate, so the prefix cache never serves one round's prompt to the next; seed 0 is
the warm-up."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnout.bench import workloads
from turnout.bench.workloads import Req
from turnout.errors import TurnoutError
from turnout.platform import Platform
from turnout.tuning.key import PROFILES

# (requests, (shortest, longest) prompt, output tokens, shared prefix): tiny on the CPU, where every
# candidate's run must take well under a second; on CUDA large enough to fill a step.
SIZES: dict[tuple[str, bool], tuple[int, tuple[int, int], int, int]] = {
    ("throughput", False): (8, (16, 64), 16, 0),
    ("throughput", True): (64, (100, 1024), 128, 0),
    ("latency", False): (1, (32, 32), 16, 0),
    ("latency", True): (1, (1024, 1024), 128, 0),
    ("prefix", False): (8, (16, 16), 16, 128),
    ("prefix", True): (64, (32, 32), 32, 1024),
}


@dataclass(frozen=True)
class Load:
    """One workload: what each round sends, and the figure it is scored by: output tokens a second, from
    the first request's arrival to the last token (for latency one request alone, so its time to first
    token counts beside its decode steps)."""

    profile: str  # throughput, latency, prefix, or a .jsonl path
    num_prompts: int
    input_len: tuple[int, int]
    output_len: int
    prefix_len: int = 0
    vocab_size: int = 10000
    file_reqs: tuple[Req, ...] = ()  # a JSONL workload's requests, as the file gives them

    metric = "tok/s"
    higher_is_better = True

    def describe(self) -> str:
        """What one run sends, in words."""
        if self.file_reqs:
            return f"{len(self.file_reqs)} requests of {self.profile}, a fresh first token each round"
        lo, hi = self.input_len
        size = f"{lo}" if lo == hi else f"{lo}-{hi}"
        shared = f" after a shared {self.prefix_len}-token prefix" if self.prefix_len else ""
        if self.profile == "latency":
            return f"output tok/s of one request of {size} tokens, {self.output_len} out, TTFT included"
        return f"output tok/s of {self.num_prompts} requests of {size} tokens{shared}, {self.output_len} out"

    def requests(self, seed: int) -> list[Req]:
        """This round's requests: drawn from seed (a JSONL file's, each led by a token drawn from seed)."""
        rng = random.Random(seed)
        ids = lambda n: [rng.randrange(self.vocab_size) for _ in range(n)]
        if self.file_reqs:
            salt = rng.randrange(self.vocab_size)
            return [Req([salt, *r.prompt], r.max_tokens) for r in self.file_reqs]
        shared = ids(self.prefix_len)
        return [
            Req(shared + ids(rng.randint(*self.input_len)), self.output_len) for _ in range(self.num_prompts)
        ]

    def run(self, llm: Any, reqs: list[Req]) -> float:
        """The figure of one run of reqs on llm."""
        seconds, tokens = workloads.run(llm, reqs)
        return tokens / seconds

    def num_blocks(self, block_size: int) -> int:
        """KV blocks that hold one round's requests all at once (plus one spare each)."""
        reqs = self.file_reqs or self.requests(0)
        longest = max(len(r.prompt) for r in reqs) + 1 + max(r.max_tokens for r in reqs)
        return len(reqs) * (math.ceil(longest / block_size) + 1)


def load_for(
    workload: str,
    platform: Platform,
    vocab_size: int,
    tokenizer: Any = None,
    tokenizer_problem: str = "none was loaded",
) -> Load:
    """The workload a profile name or a JSONL file names, sized for this platform; a JSONL file's text
    prompts need the tokenizer, and without one (None) fail with tokenizer_problem."""
    if workload in PROFILES:
        n, lens, out, prefix = SIZES[workload, platform.is_cuda]
        return Load(workload, n, lens, out, prefix, vocab_size)
    if not workload.endswith(".jsonl") or not Path(workload).is_file():
        raise TurnoutError(
            f"unknown workload {workload!r}: use throughput, latency, prefix or an existing FILE.jsonl"
        )
    out = SIZES["throughput", platform.is_cuda][2]
    reqs = tuple(workloads.from_jsonl(workload, tokenizer, out, tokenizer_problem))
    lens = (min(len(r.prompt) for r in reqs), max(len(r.prompt) for r in reqs))
    return Load(workload, len(reqs), lens, out, 0, vocab_size, reqs)
