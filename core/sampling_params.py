"""Per-request sampling parameters, vLLM's fields and meanings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from turnout.errors import RequestError
from turnout.structured_outputs import StructuredOutputsParams

_INTS = {"n": 1, "top_k": -1, "max_tokens": 1, "min_tokens": 0}  # field -> smallest allowed value
_OPTIONAL_INTS = {"best_of": 1, "seed": 0, "logprobs": 0, "prompt_logprobs": 0}
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes [0, 2**64)
_engine_logprobs_cap = 0  # the largest max_logprobs of an engine built in this process


def allow_logprobs(cap: int) -> None:
    """An engine that serves up to cap logprobs exists: SamplingParams built from now on may ask that many."""
    global _engine_logprobs_cap
    _engine_logprobs_cap = max(_engine_logprobs_cap, cap)


def logprobs_cap() -> int:
    """The most logprobs / prompt_logprobs a SamplingParams may ask for when built: the engine setting
    max_logprobs as its defaults and the environment give it, or an engine built in this process allows.
    Each engine still holds a request to its own max_logprobs."""
    from turnout.config import EngineConfig

    return max(EngineConfig.load().max_logprobs, _engine_logprobs_cap)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    n completions are returned; best_of >= n are sampled and the n with the highest cumulative logprob kept.
    min_tokens: EOS and stop_token_ids are masked, and stop strings not checked, until that many tokens.
    logit_bias {token id: bias} is added to the logits; bad_words are never generated (a word of several
    tokens has its last token masked after the others).
    logprobs=N returns, per generated token, the chosen token and the top N under the raw model
    distribution (as vLLM's default); prompt_logprobs=N the same for every prompt token after the first.
    Both are capped by the engine setting max_logprobs (20 unless configured), checked when built against
    the largest an engine here allows (`logprobs_cap`), and by each engine against its own.
    structured_outputs holds the output to a JSON schema, a regex, a choice or a grammar
    (`StructuredOutputsParams`, or a dict of its one field).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # set by the engine when it accepts the request (from its tokenizer and EOS ids)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    eos_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, low in {**_INTS, **_OPTIONAL_INTS}.items():
            _check_int(name, getattr(self, name), low, optional=name in _OPTIONAL_INTS)
        for name in _FLOATS:
            setattr(self, name, _check_float(name, getattr(self, name)))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.stop = _check_strings("stop", self.stop, allow_one=True)
        self.bad_words = _check_strings("bad_words", self.bad_words, allow_one=False, optional=True)
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        _check_logprobs(self.logprobs, self.prompt_logprobs)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                keys = "json, json_object, regex, choice or grammar"
                _fail(f"structured_outputs takes {keys}, got {self.structured_outputs!r}")
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            _fail(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}",
            ),
            (self.seed is None or self.seed < SEED_LIMIT, f"seed must be below 2**64, got {self.seed}"),
            (self.best_of is None or self.best_of >= self.n, f"best_of {self.best_of} must be >= n {self.n}"),
            (
                self.best_of is None or self.best_of == 1 or not self.greedy,
                "best_of > 1 needs sampling (temperature > 0): greedy completions are all the same",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                _fail(msg)

    @classmethod
    def field_names(cls) -> list[str]:
        """The fields a user sets (the engine fills the others)."""
        return [f.name for f in fields(cls) if f.init]

    @property
    def greedy(self) -> bool:
        """temperature 0: the sampler takes the most likely token; seed, top_k, top_p and min_p do nothing."""
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        """A repetition, presence or frequency penalty is set: the sampler needs the tokens so far."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_processing(self) -> bool:
        """The sampler edits this row's logits first: bad words, min_tokens, logit_bias, penalties."""
        return bool(self.bad_words_token_ids or self.min_tokens or self.logit_bias) or self.needs_penalties

    @property
    def needs_output_tokens(self) -> bool:
        """The sampler reads this request's generated tokens themselves, not only their count: under async
        scheduling a step that samples for it is read before the next step is scheduled. (A structured
        output's grammar takes them on the host, between the next step's forward and its sampling.)"""
        return self.needs_penalties or bool(self.bad_words)

    @property
    def needs_history(self) -> bool:
        """The sampler or the runner reads this request's prompt and output tokens every step."""
        return (
            self.needs_penalties
            or bool(self.bad_words)
            or self.min_tokens > 0
            or self.prompt_logprobs is not None
        )


def _fail(msg: str) -> None:
    raise RequestError(f"invalid SamplingParams: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v: Any, low: int, optional: bool) -> None:
    if v is None and optional:
        return
    if not _is_int(v):
        _fail(f"{name} must be an integer{' or None' if optional else ''}, got {v!r} ({type(v).__name__})")
    if v < low:
        _fail(f"{name} must be >= {low}, got {v}")


def _check_logprobs(*asked: int | None) -> None:
    from turnout.config import EngineConfig

    if max(n or 0 for n in asked) <= EngineConfig.model_fields["max_logprobs"].default:
        return  # within the default cap: no environment to read
    cap = logprobs_cap()
    for name, n in zip(("logprobs", "prompt_logprobs"), asked):
        if n is not None and n > cap:
            _fail(
                f"{name}={n} exceeds max_logprobs {cap}; ask for at most {cap}, or build the LLM with a "
                f"larger max_logprobs (or set TURNOUT_MAX_LOGPROBS) first"
            )


def _check_float(name: str, v: Any) -> float:
    if not (_is_int(v) or isinstance(v, float)):
        _fail(f"{name} must be a number, got {v!r} ({type(v).__name__})")
    if not math.isfinite(v):
        _fail(f"{name} must be finite, got {v}")
    return float(v)


def _check_strings(name: str, v: Any, allow_one: bool, optional: bool = False) -> list[str] | None:
    if v is None and optional:
        return None
    if isinstance(v, str) and allow_one:
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        _fail(f"{name} must be a list of strings, got {v!r}")
    if any(not s for s in v):
        _fail(f"{name} holds an empty string, which would match everywhere; remove it")
    return list(v)


def _check_token_ids(name: str, v: Any) -> list[int]:
    if not isinstance(v, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in v):
        _fail(f"{name} must be a list of token ids (integers >= 0), got {v!r}")
    return list(v)


def _check_logit_bias(v: Any) -> dict[int, float] | None:
    """{token id: bias}; JSON object keys arrive as strings of digits, as in OpenAI's API."""
    if v is None:
        return None
    if not isinstance(v, dict):
        _fail(f"logit_bias must map token ids to numbers, got {v!r}")
    out = {}
    for k, b in v.items():
        tok = int(k) if isinstance(k, str) and k.isdigit() else k
        if not _is_int(tok) or tok < 0:
            _fail(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        out[tok] = _check_float(f"logit_bias[{tok}]", b)
    return out
