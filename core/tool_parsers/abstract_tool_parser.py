"""The tool-call parser contract: `ToolParser`, what it returns whole (`ParsedToolCalls`) and as the text
streams (`DeltaMessage`), and `join_deltas`, which adds a stream up."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments object's JSON text exactly as the model wrote it."""

    name: str
    arguments: str


@dataclass
class ParsedToolCalls:
    """A whole output parsed: the text outside the calls ("" if none) and the calls in order."""

    content: str
    tool_calls: list[ParsedToolCall]


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its name on the call's first delta only, then text to append to its
    arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass
class DeltaMessage:
    """What one `feed` or `finish` adds: content text and pieces of calls."""

    content: str
    tool_calls: list[ToolCallDelta]


class ToolParser:
    """Turns a chat completion's text into tool calls: whole with `parse`, or as it streams with `feed` and
    then `finish`. A streaming parser holds state, so keep one instance per streamed choice.

    However the text is cut into deltas, the streamed content joined equals `parse(text).content`, and per
    index the first delta names the call and the joined arguments equal that call's `arguments`.
    """

    name: ClassVar[str]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str) -> ParsedToolCalls:
        """The whole output at once; by default what a fresh parser streams when fed it in one piece."""
        fresh = type(self)(self.tokenizer)
        return join_deltas([fresh.feed(text), fresh.finish()])

    def feed(self, delta: str) -> DeltaMessage:
        """Read the text added since the last call; return the content and call pieces now certain."""
        raise NotImplementedError

    def finish(self) -> DeltaMessage:
        """The stream ended: return what was held back, such as a partial tag, now known to be content."""
        raise NotImplementedError


def join_deltas(messages: Iterable[DeltaMessage]) -> ParsedToolCalls:
    """What a stream of `DeltaMessage`s adds up to."""
    content, names, arguments = [], {}, {}
    for msg in messages:
        content.append(msg.content)
        for d in msg.tool_calls:
            if d.name is not None:
                names[d.index] = d.name
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
    calls = [ParsedToolCall(names[i], arguments[i]) for i in sorted(names)]
    return ParsedToolCalls("".join(content), calls)
