"""Hermes-style tool calls (Hermes, Qwen2.5, Qwen3): each call is
`<tool_call>\\n{"name": "fn", "arguments": {...}}\\n</tool_call>`, and the text outside the tags is content.

A `<tool_call>` that does not open such a call is content itself, and reading goes on right after it.
"""

from __future__ import annotations

from turnout.tool_parsers import DeltaMessage
from turnout.tool_parsers.json_calls import JsonCallParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(JsonCallParser):
    """`<tool_call>` JSON `</tool_call>` blocks, as Hermes and Qwen chat templates teach."""

    name = "hermes"
    close = CLOSE

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self._held = ""  # content that may be the start of OPEN

    def feed(self, delta: str) -> DeltaMessage:
        """Read the text added since the last call."""
        self._run(delta)
        return self._out.take()

    def finish(self) -> DeltaMessage:
        """An unterminated call and a partial tag are content now."""
        while self._call is not None:
            self._run(self._drop_call())
        self._out.content(self._held)
        self._held = ""
        return self._out.take(final=True)

    def _run(self, text: str) -> None:
        while text:
            text = self._read_call(text) if self._call else self._read_content(text)

    def _read_content(self, text: str) -> str:
        text, self._held = self._held + text, ""
        at = text.find(OPEN)
        if at >= 0:
            self._out.content(text[:at])
            self._open_call()
            return text[at + len(OPEN) :]
        keep = _may_open(text)
        self._out.content(text[: len(text) - keep])
        self._held = text[len(text) - keep :]
        return ""

    def _read_call(self, text: str) -> str:
        rest = text[self._call.advance(text) :]
        if self._call.failed:
            return self._drop_call() + rest
        if self._call.done:
            self._close_call()
        return rest

    def _drop_call(self) -> str:
        """End a call that failed or did not finish; return its text to read again as content."""
        call = self._close_call()
        if not call.emitted:
            self._out.content(OPEN)
        return call.leftover


def _may_open(text: str) -> int:
    """How many characters at the end of `text` may be the start of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
