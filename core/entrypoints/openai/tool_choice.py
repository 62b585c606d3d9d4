"""How a chat request's `tools` and `tool_choice` shape its sampling, and how its output becomes OpenAI
`tool_calls`, whole or as stream deltas.

- "none": tools are rendered by the chat template, the output is content.
- "auto": the server's tool-call parser (`--tool-call-parser`) reads calls out of the output.
- "required": a JSON schema holds the output to a list of at least one call, [{"name", "parameters"}].
- a named function: a JSON schema holds the output to that function's arguments object.

An output cut at max_tokens keeps the call it was writing, its arguments as far as they got, with
finish_reason "length" (a complete call ends with "tool_calls"); streamed or not, the calls are the same.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from turnout.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from turnout.structured_outputs import StructuredOutputsParams
from turnout.tool_parsers import DeltaMessage, ParsedToolCalls, ToolParser, join_deltas
from turnout.tool_parsers.json_calls import JSON_WS, JsonCallParser

ANY_OBJECT = {"type": "object"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallState:
    """One call as it streams: its id, and whether its name went out."""

    id: str = field(default_factory=call_id)
    named: bool = False


def tool_call(name: str, arguments: str, id: str | None = None) -> dict[str, Any]:
    return {"id": id or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolChoice:
    """A request's tool mode: "none", "auto", "required" or the named function's name."""

    def __init__(
        self, req: ChatCompletionRequest, parser: type[ToolParser] | None, auto_enabled: bool
    ) -> None:
        tools = req.tools or []
        self.params = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
        if len(self.params) < len(tools):
            raise OpenAIError(400, "tools holds two functions of the same name; rename one", param="tools")
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        self.parallel = req.parallel_tool_calls is not False
        self.parser = parser
        if not isinstance(choice, str):
            choice = choice.function.name
            if choice not in self.params:
                known = ", ".join(self.params) or "no tools"
                raise OpenAIError(
                    400, f"tool_choice names function '{choice}', which tools does not hold ({known})",
                    param="tool_choice",
                )  # fmt: skip
            self.mode, self.name = "named", choice
        else:
            self.mode, self.name = choice, None
        if self.mode != "none" and not tools:
            raise OpenAIError(400, f'tool_choice "{self.mode}" needs tools; send tools', param="tool_choice")
        if self.mode == "auto" and (parser is None or not auto_enabled):
            raise OpenAIError(
                400,
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                '--tool-call-parser NAME; or send tool_choice "required" or a named function',
                param="tool_choice",
            )
        if self.mode in ("named", "required") and (req.response_format or req.structured_outputs):
            raise OpenAIError(
                400, f'tool_choice "{self.mode}" constrains the output itself; leave out response_format '
                "and structured_outputs", param="tool_choice",
            )  # fmt: skip

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that makes the output a call: None for "none" and "auto"."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.params[self.name])  # type: ignore[index]
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
            }
            for n, p in self.params.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def engine_error(self, e: OpenAIError) -> OpenAIError:
        """The engine's refusal of the constraint this made, told as the tools' fault."""
        if self.mode in ("named", "required") and e.param == "structured_outputs":
            msg = e.message.split(": ", 1)[-1]
            return OpenAIError(
                400, f"tools: a function's parameters are not a usable JSON schema ({msg})", param="tools"
            )
        return e

    def message(self, text: str, tokenizer: Any, finish_reason: str | None) -> tuple[dict[str, Any], bool]:
        """The assistant message of a finished output, and whether it holds calls."""
        content, calls = self._calls(text, tokenizer, finish_reason)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            msg["tool_calls"] = [tool_call(n, a) for n, a in calls]
        return msg, bool(calls)

    def _calls(self, text: str, tokenizer: Any, finish: str | None) -> tuple[str, list[tuple[str, str]]]:
        if self.mode == "named":
            return "", [(self.name, text)]  # type: ignore[list-item]
        if self.mode == "none":
            return text, []
        if self.mode == "required":
            parsed = streamed(RequiredCalls(tokenizer), text)
        elif finish == "length":  # what a stream gave out: the cut call, kept
            parsed = streamed(self.parser(tokenizer), text)  # type: ignore[misc]
        else:
            parsed = self.parser(tokenizer).parse(text)  # type: ignore[misc]
        return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]

    def stream(self, tokenizer: Any) -> ToolStream:
        return ToolStream(self, tokenizer)


def streamed(parser: ToolParser, text: str) -> ParsedToolCalls:
    """What `parser` gives out when `text` streams through it."""
    return join_deltas([parser.feed(text), parser.finish()])


class RequiredCalls(JsonCallParser):
    """The "required" constraint's output, `[{"name": "fn", "parameters": {...}}, ...]`, as it streams: a
    call goes out once its parameters open (the schema puts "name" first), then its parameters as they
    arrive. Text that forms no call, as an output cut before a call's parameters open, is content."""

    arg_keys = ("parameters",)

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._next = "["  # the characters that may come next between calls; "" once the list closed
        self._held = ""  # the list's text since the last call: content only if no call follows it
        self._rest = False  # the output left the list's shape: the rest is content

    def feed(self, delta: str) -> DeltaMessage:
        """Read the text added since the last call."""
        while delta:
            if self._rest:
                self._out.content(delta)
                break
            delta = self._read_call(delta) if self._call else self._read_between(delta)
        return self._out.take()

    def finish(self) -> DeltaMessage:
        """A call cut before its parameters opened, and the list's text around it, are content."""
        if self._call is not None:
            self._end_call()
        self._out.content(self._held)
        self._held = ""
        return self._out.take(final=True)

    def _read_between(self, text: str) -> str:
        for i, ch in enumerate(text):
            if ch in JSON_WS:
                continue
            if ch not in self._next:
                self._out.content(self._held + text[:i])
                self._held, self._rest = "", True
                return text[i:]
            if ch == "{":
                self._held += text[:i]
                self._open_call()
                return text[i:]
            if ch == "]":  # the list is whole: its text is no content
                self._held, self._next = "", ""
                return text[i + 1 :]
            self._next = "{"
        self._held += text
        return ""

    def _read_call(self, text: str) -> str:
        rest = text[self._call.advance(text) :]
        if self._call.done:
            self._close_call()
            self._held, self._next = "", ",]"
        elif self._call.failed:
            self._end_call()
            self._rest = True
        return rest

    def _end_call(self) -> None:
        call = self._close_call()
        self._out.content(call.leftover if call.emitted else self._held + call.leftover)
        self._held = ""


class ToolStream:
    """One streamed choice: its text deltas in, (content, tool-call deltas in OpenAI's shape) out."""

    def __init__(self, choice: ToolChoice, tokenizer: Any) -> None:
        self.choice = choice
        parsers = {"auto": choice.parser, "required": RequiredCalls}
        self.parser = parsers[choice.mode](tokenizer) if choice.mode in parsers else None  # type: ignore[misc]
        self.calls: dict[int, ToolCallState] = {}

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self.choice.mode == "named":
            return "", [self._delta(0, self.choice.name, delta)]
        return self._deltas(self.parser.feed(delta)) if self.parser is not None else (delta, [])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._deltas(self.parser.finish()) if self.parser is not None else ("", [])

    def _deltas(self, d: DeltaMessage) -> tuple[str, list[dict[str, Any]]]:
        return d.content, [self._delta(t.index, t.name, t.arguments) for t in d.tool_calls]

    def _delta(self, index: int, name: str | None, arguments: str) -> dict[str, Any]:
        state = self.calls.setdefault(index, ToolCallState())
        if state.named:
            return {"index": index, "function": {"arguments": arguments}}
        state.named = True
        return {
            "index": index,
            "id": state.id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
