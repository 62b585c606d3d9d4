"""What the JSON tool-call parsers share: a call object read a character at a time, the content rule, and
when a call is given out.

Content rule: content is all the text outside the calls, with leading and trailing whitespace stripped
overall, so a stream holds trailing whitespace back until more content follows it.

A call is given out when it is certain. `parse` waits for the whole call and checks its arguments parse as a
JSON object; a stream commits as soon as the arguments object opens (name and key known), then streams the
arguments as they arrive. So the two agree on every text but one whose call goes wrong after its arguments
began (invalid JSON inside them, bad text after them, or the output ends): `parse` makes that call content,
while the stream has already given it out, and keeps it.
"""

from __future__ import annotations

import json

from turnout.tool_parsers import DeltaMessage, ParsedToolCalls, ToolCallDelta, ToolParser, join_deltas

JSON_WS = " \t\n\r"
_NAME, _ARGS = object(), object()  # the call's name value and its arguments object


class Output:
    """The content and call pieces of one `feed`, with the content rule applied."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []
        self._started = False  # some non-whitespace content has been given out
        self._ws = ""  # trailing whitespace held back

    def content(self, text: str) -> None:
        """Add text outside the calls."""
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if body:
            self._content.append(self._ws + body)
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def call(self, index: int, name: str | None, arguments: str) -> None:
        """Add to call `index`: its name (first piece only) and arguments text."""
        last = self._calls[-1] if self._calls else None
        if name is None and last is not None and last.index == index:
            last.arguments += arguments
        elif name is not None or arguments:
            self._calls.append(ToolCallDelta(index, name, arguments))

    def take(self, final: bool = False) -> DeltaMessage:
        """What was added since the last take; `final` drops the held trailing whitespace."""
        msg = DeltaMessage("".join(self._content), self._calls)
        self._content, self._calls = [], []
        if final:
            self._ws = ""
        return msg


class CallScanner:
    """Reads one call object `{"name": "fn", "<key>": {...}}`, a key of `arg_keys`, then `close`, with JSON
    whitespace allowed between the parts. The arguments' end is found by brace depth outside JSON strings.

    `advance(text)` consumes characters until the call is `done` or `failed` (the text cannot be such a
    call). Call piece `index` goes to `out`: with `stream`, once the arguments open and as they arrive;
    otherwise all at once when the call is done and its arguments are a JSON object.
    """

    def __init__(self, out: Output, index: int, arg_keys: tuple[str, ...], close: str, stream: bool) -> None:
        self.out, self.index, self.stream = out, index, stream
        self._parts: list[object] = ["{", ("name",), ":", _NAME, ",", arg_keys, ":", _ARGS, "}"]
        self._parts += [close] if close else []
        self._part = 0  # index into _parts
        self._matched = 0  # chars of a literal part matched so far
        self._string: str | None = None  # a key or the name being read, its opening quote included
        self._depth = 0  # brace depth inside the arguments
        self._in_string = self._escape = False
        self.raw = ""
        self.name: str | None = None
        self._args: list[int] = []  # [start] then [start, end] in raw
        self._sent = 0  # arguments chars given out
        self.emitted = self.failed = False

    @property
    def done(self) -> bool:
        """The whole call, `close` included, has been read."""
        return self._part == len(self._parts)

    @property
    def leftover(self) -> str:
        """The call's text not given out: all of it, or once it is emitted, what follows the arguments."""
        if not self.emitted:
            return self.raw
        return self.raw[self._args[1] :] if len(self._args) == 2 else ""

    def advance(self, text: str) -> int:
        """Read from `text`; return how many characters belong to this call."""
        used = len(text)
        for i, ch in enumerate(text):
            self._step(ch, len(self.raw) + i)
            if self.failed or self.done:
                used = i + 1
                break
        self.raw += text[:used]
        if self.stream and self._args:  # committed when the arguments opened, so even if it failed since
            self._stream_arguments()
        elif self.done:
            self._give_whole()
        return used

    def _stream_arguments(self) -> None:
        start = self._args[0]
        end = self._args[1] if len(self._args) == 2 else len(self.raw)
        piece = self.raw[start + self._sent : end]
        self.out.call(self.index, None if self.emitted else self.name, piece)
        self.emitted, self._sent = True, self._sent + len(piece)

    def _give_whole(self) -> None:
        arguments = self.raw[self._args[0] : self._args[1]]
        try:
            ok = isinstance(json.loads(arguments), dict)
        except ValueError:
            ok = False
        if ok:
            self.out.call(self.index, self.name, arguments)
            self.emitted = True
        else:
            self.failed = True

    def _step(self, ch: str, at: int) -> None:
        if self._depth:
            self._step_arguments(ch, at)
        elif self._string is not None:
            self._step_string(ch)
        elif self._matched or ch not in JSON_WS:
            self._step_part(ch, at)

    def _step_part(self, ch: str, at: int) -> None:
        part = self._parts[self._part]
        if part is _ARGS and ch == "{":
            self._depth, self._args = 1, [at]
        elif (part is _NAME or isinstance(part, tuple)) and ch == '"':
            self._string = ch
        elif isinstance(part, str) and ch == part[self._matched]:
            self._matched += 1
            if self._matched == len(part):
                self._part, self._matched = self._part + 1, 0
        else:
            self.failed = True

    def _step_string(self, ch: str) -> None:
        self._string += ch
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._end_string(self._string)

    def _end_string(self, literal: str) -> None:
        self._string, part = None, self._parts[self._part]
        try:
            value = json.loads(literal)
        except ValueError:
            value = None
        if part is _NAME and value:
            self.name = value
        elif part is _NAME or value not in part:
            self.failed = True
            return
        self._part += 1

    def _step_arguments(self, ch: str, at: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{}":
            self._depth += 1 if ch == "{" else -1
            if not self._depth:
                self._args.append(at + 1)
                self._part += 1


class JsonCallParser(ToolParser):
    """A parser whose calls are `CallScanner` objects: `parse` runs a fresh instance that gives each call out
    only once it is whole and valid (see the module's note)."""

    arg_keys: tuple[str, ...] = ("arguments",)
    close = ""

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self._out = Output()
        self._stream = True
        self._index = 0  # the next call's index
        self._call: CallScanner | None = None

    def parse(self, text: str) -> ParsedToolCalls:
        """The whole output at once; a call whose arguments are not a JSON object is content."""
        fresh = type(self)(self.tokenizer)
        fresh._stream = False
        return join_deltas([fresh.feed(text), fresh.finish()])

    def _open_call(self) -> None:
        self._call = CallScanner(self._out, self._index, self.arg_keys, self.close, self._stream)

    def _close_call(self) -> CallScanner:
        call, self._call = self._call, None
        self._index += call.emitted
        return call
