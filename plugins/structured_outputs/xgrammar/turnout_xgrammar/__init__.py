"""The xgrammar structured-output backend: grammars compiled against the tokenizer's vocabulary, one
GrammarMatcher per request. JSON is written compactly (xgrammar's separators ", " and ": ", no other
whitespace), so a small model cannot run out its max_tokens on blank space."""

from __future__ import annotations

import json
from typing import Any

import torch

from turnout import hookimpl
from turnout.structured_outputs import Grammar, StructuredOutputBackend


class XGrammarMatcher(Grammar):
    """A request's xgrammar GrammarMatcher."""

    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    """xgrammar (what vLLM and SGLang use by default)."""

    name = "xgrammar"
    priority = 10

    @classmethod
    def import_error(cls) -> str | None:
        try:
            import xgrammar  # noqa: F401
        except ImportError as e:
            return f"{e}; pip install xgrammar"
        return None

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
        )
        self.xgr, self.compiler = xgr, xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, kind: str, spec: str) -> Any:
        c = self.compiler
        try:
            if kind == "json":
                return c.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI means it (the built-in grammar takes any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(spec)))
            return c.compile_grammar(spec)
        except (
            RuntimeError,
            ValueError,
            TypeError,
        ) as e:  # xgrammar's parse errors: "[time] file:line: message"
            raise ValueError(str(e).strip().split(": ", 1)[-1]) from None

    def matcher(self, compiled: Any) -> Grammar:
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled))


@hookimpl
def turnout_structured_output_backends() -> list[type[StructuredOutputBackend]]:
    return [XGrammarBackend]
