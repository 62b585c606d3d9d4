"""Llama 3.1/3.2 JSON tool calls: after optional whitespace and an optional `<|python_tag|>`, the output is
`{"name": "fn", "parameters": {...}}` ("arguments" also accepted), several separated by `;`.

An output that does not start so is all content. From the first text that is neither a call nor a `;`
between calls (a malformed call included), the rest of the output is content.
"""

from __future__ import annotations

from turnout.tool_parsers import DeltaMessage
from turnout.tool_parsers.json_calls import JsonCallParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonCallParser):
    """JSON calls at the start of the output, as Llama 3.1/3.2's JSON tool-calling prompt teaches."""

    name = "llama3_json"
    arg_keys = ("parameters", "arguments")

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self._mode = "lead"  # "lead", then "call" and "sep" in turn; "content" once the rest is content
        self._held = ""  # undecided text before a call: leading whitespace and tag, or a separator

    def feed(self, delta: str) -> DeltaMessage:
        """Read the text added since the last call."""
        self._run(delta)
        return self._out.take()

    def finish(self) -> DeltaMessage:
        """An unterminated call and undecided text are content now."""
        if self._call is not None:
            self._drop_call()
        self._out.content(self._held)
        self._held = ""
        return self._out.take(final=True)

    def _run(self, text: str) -> None:
        while text:
            if self._mode == "content":
                self._out.content(text)
                return
            read = {"lead": self._read_lead, "sep": self._read_sep, "call": self._read_call}[self._mode]
            text = read(text)

    def _read_lead(self, text: str) -> str:
        text, self._held = self._held + text, ""
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(body):
            body = ""
        return self._start_call(text, body)

    def _read_sep(self, text: str) -> str:
        text, self._held = self._held + text, ""
        body = text.lstrip()
        if body.startswith(";"):
            body = body[1:].lstrip()
        elif body:
            self._mode = "content"
            return text
        return self._start_call(text, body)

    def _start_call(self, text: str, body: str) -> str:
        """`text` so far, `body` what follows its lead or separator: wait, open a call, or make it content."""
        if not body:
            self._held = text
            return ""
        if body[0] != "{":
            self._mode = "content"
            return text
        self._held, self._mode = text[: len(text) - len(body)], "call"
        self._open_call()
        return body

    def _read_call(self, text: str) -> str:
        rest = text[self._call.advance(text) :]
        if self._call.failed:
            self._drop_call()
        elif self._call.done:
            self._close_call()
            self._held, self._mode = "", "sep"
        return rest

    def _drop_call(self) -> None:
        call = self._close_call()
        self._out.content(call.leftover if call.emitted else self._held + call.leftover)
        self._held, self._mode = "", "content"
