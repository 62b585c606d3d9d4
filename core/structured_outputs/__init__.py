"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regex, one of several
strings or an EBNF grammar, as vLLM's `StructuredOutputsParams`.

The engine compiles each constraint once (`StructuredOutputManager`, cached by its text), keeps one
`Grammar` per request, fills the token bitmask of a step's constrained rows on the host while the forward
runs, and the sampler masks those rows' logits on the device (`apply_token_bitmask`). Rows without a
constraint are not touched. Grammar engines are plugins (`turnout_structured_output_backends`).

A bitmask is an int32 tensor [rows, ceil(vocab / 32)]: bit j of word w allows token 32 * w + j.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from turnout.errors import RequestError

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: json (a JSON schema, as a dict or its text), json_object (any JSON object),
    regex, choice (the output is one of these strings) or grammar (EBNF, in the backend's dialect)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) or "none"
            _fail(f"give exactly one of {', '.join(KINDS)} (got {got})")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                _fail(f"json is not valid JSON: {e}")
        elif self.json is not None and not isinstance(self.json, dict):
            _fail(f"json must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            _fail(f"choice must be a non-empty list of strings, got {self.choice!r}")
        for k in ("regex", "grammar"):
            if (v := getattr(self, k)) is not None and (not isinstance(v, str) or not v):
                _fail(f"{k} must be a non-empty string, got {v!r}")
        if not isinstance(self.json_object, bool):
            _fail(f"json_object must be true or false, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "json_object", "regex", "choice" or "grammar" (a backend's
        compile(kind, spec) takes it)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the key compiled grammars are cached by, with kind."""
        v = getattr(self, self.kind)
        if self.kind == "json":
            return v if isinstance(v, str) else json.dumps(v, sort_keys=True)
        if self.kind == "choice":
            return json.dumps(v)
        return "" if self.kind == "json_object" else v

    def as_dict(self) -> dict[str, Any]:
        """The one field set, as SamplingParams travel between processes."""
        return {self.kind: getattr(self, self.kind)}


def _fail(msg: str) -> None:
    raise RequestError(f"invalid structured_outputs: {msg}")


class Grammar:
    """One request's matcher: where in the grammar its output is."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the state is unchanged)."""
        raise NotImplementedError

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 words, on the host)."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """The output is complete: the grammar has accepted a stop token at an end state."""
        raise NotImplementedError


class StructuredOutputBackend:
    """A grammar engine. Built once per engine, on the first constrained request, as
    `Backend(tokenizer, vocab_size, eos_token_ids)`; vocab_size is the model's logits width."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0

    @classmethod
    def import_error(cls) -> str | None:
        """Why this backend cannot run here (its library is missing), or None."""
        return None

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids

    def compile(self, kind: str, spec: str) -> Any:
        """A compiled grammar for `StructuredOutputsParams` kind and spec; raise ValueError with the reason
        where it cannot be compiled (a bad schema, regex or grammar)."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Grammar:
        """A fresh matcher at the grammar's start."""
        raise NotImplementedError


@dataclass
class GrammarOutput:
    """A step's constrained rows, as the executor hands them to sample_tokens: the request ids, and their
    bitmask rows in that order."""

    req_ids: list[str]
    bitmask: torch.Tensor  # [len(req_ids), ceil(vocab / 32)] int32, on the host


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask: one bit per token id, ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0; in place, on logits' device. On a GPU
    the host never waits: bitmask and rows reach it from pinned memory (a pageable copy would first wait
    for the forward queued before it, and leave the GPU idle while the next step is scheduled)."""
    import torch

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if logits.is_cuda and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(logits.device, non_blocking=True)

    idx, words = to_device(torch.as_tensor(rows, dtype=torch.long)), to_device(bitmask)
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits[idx] = logits[idx].masked_fill(~allowed, -float("inf"))


__all__ = [
    "Grammar",
    "GrammarOutput",
    "StructuredOutputBackend",
    "StructuredOutputsParams",
    "apply_token_bitmask",
    "bitmask_words",
]
