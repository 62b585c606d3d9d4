"""Tool-call parsers: hermes and llama3_json whole and streamed, streaming == parse however the text is cut,
and lookup through the real plugin manager."""

from __future__ import annotations

import json
import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout import hookimpl
from turnout.entrypoints.openai.tool_choice import RequiredCalls
from turnout.errors import ConfigError
from turnout.tool_parsers import (
    ParsedToolCall,
    ParsedToolCalls,
    ToolParser,
    get_tool_parser,
    tool_parser_names,
)
from turnout.tool_parsers.hermes import HermesToolParser
from turnout.tool_parsers.llama3_json import Llama3JsonToolParser

TRICKY_ARGS = r'{"code": "if (x) { return \"}\"; }", "q": "a \"quoted\" {word}", "n": {"deep": [{"k": {}}]}}'
END_TAG_ARGS = '{"html": "</tool_call>", "more": "}</tool_call>{"}'


def hermes(name: str, args: str, ws: str = "\n") -> str:
    return f'<tool_call>{ws}{{"name": "{name}", "arguments": {args}}}{ws}</tool_call>'


def llama(name: str, args: str, key: str = "parameters") -> str:
    return f'{{"name": "{name}", "{key}": {args}}}'


def stream(cls: type[ToolParser], pieces: list[str]) -> ParsedToolCalls:
    """Feed `pieces` to a fresh parser and join what comes out, checking the delta rules on the way."""
    parser = cls(None)
    messages = [parser.feed(p) for p in pieces] + [parser.finish()]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for msg in messages:
        for d in msg.tool_calls:
            if d.index in names:
                assert d.name is None, "only a call's first delta carries its name"
            else:
                assert d.name and d.index == len(names), "calls are numbered in order, named first"
                names[d.index], args[d.index] = d.name, ""
            args[d.index] += d.arguments
    content = "".join(m.content for m in messages)
    return ParsedToolCalls(content, [ParsedToolCall(names[i], args[i]) for i in sorted(names)])


def calls(*pairs: tuple[str, str]) -> list[ParsedToolCall]:
    return [ParsedToolCall(n, a) for n, a in pairs]


HERMES_CASES = [
    (hermes("get_weather", '{"city": "Paris"}'), "", calls(("get_weather", '{"city": "Paris"}'))),
    (hermes("a", '{"x": 1}') + "\n" + hermes("b", "{}"), "", calls(("a", '{"x": 1}'), ("b", "{}"))),
    (hermes("a", "{}", ws="") + hermes("b", "{ }", ws=" \t"), "", calls(("a", "{}"), ("b", "{ }"))),
    ("Let me look.\n\n" + hermes("f", "{}"), "Let me look.", calls(("f", "{}"))),
    ("Before " + hermes("f", "{}") + " after ", "Before  after", calls(("f", "{}"))),
    ("  just text\n", "just text", []),
    ("", "", []),
    ("a <toolbox> and <tool", "a <toolbox> and <tool", []),
    (hermes("f", TRICKY_ARGS), "", calls(("f", TRICKY_ARGS))),
    (hermes("f", END_TAG_ARGS), "", calls(("f", END_TAG_ARGS))),
    ('<tool_call>{"name": "get\\u005fx", "arguments": {}}</tool_call>', "", calls(("get_x", "{}"))),
    (hermes("f", "{}") + " <tool_call>", "<tool_call>", calls(("f", "{}"))),
]

HERMES_MALFORMED = [
    hermes("f", '{"a": tru}'),  # invalid JSON in the arguments
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}, "id": 1}\n</tool_call>',
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',  # unterminated
    '<tool_call>\n{"name": "f", "argu',
]


@pytest.mark.parametrize("text, content, tool_calls", HERMES_CASES)
def test_hermes_parse(text, content, tool_calls):
    assert HermesToolParser(None).parse(text) == ParsedToolCalls(content, tool_calls)
    for args in (c.arguments for c in tool_calls):
        assert args in text and isinstance(json.loads(args), dict)


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_call_is_content(text):
    text = "Hi. " + text + " Bye."
    assert HermesToolParser(None).parse(text) == ParsedToolCalls(text, [])


def test_hermes_reads_on_after_a_malformed_call():
    text = "<tool_call>oops</tool_call>\n" + hermes("f", '{"a": "<tool_call>"}')
    assert HermesToolParser(None).parse(text) == ParsedToolCalls(
        "<tool_call>oops</tool_call>", calls(("f", '{"a": "<tool_call>"}'))
    )


def test_a_naive_split_would_cut_these_arguments():
    text = "ok " + hermes("f", END_TAG_ARGS) + " " + hermes("g", TRICKY_ARGS)
    want = ParsedToolCalls("ok", calls(("f", END_TAG_ARGS), ("g", TRICKY_ARGS)))
    assert HermesToolParser(None).parse(text) == want
    assert stream(HermesToolParser, list(text)) == want


LLAMA_CASES = [
    (llama("get_weather", '{"city": "Paris"}'), "", calls(("get_weather", '{"city": "Paris"}'))),
    ("  <|python_tag|>" + llama("f", "{}"), "", calls(("f", "{}"))),
    ("<|python_tag|> \n" + llama("f", '{"a": 1}', "arguments"), "", calls(("f", '{"a": 1}'))),
    (
        llama("a", '{"x": 1}') + "; " + llama("b", "{}") + ";" + llama("c", "{}"),
        "",
        calls(("a", '{"x": 1}'), ("b", "{}"), ("c", "{}")),
    ),
    (llama("f", TRICKY_ARGS), "", calls(("f", TRICKY_ARGS))),
    (llama("f", '{"s": "a; {\\"name\\": 1}"}'), "", calls(("f", '{"s": "a; {\\"name\\": 1}"}'))),
    (llama("f", "{}") + "\n", "", calls(("f", "{}"))),
    (llama("f", "{}") + " I called f.", "I called f.", calls(("f", "{}"))),
    (
        llama("f", "{}") + "; " + llama("g", '{"a": tru}'),
        '; {"name": "g", "parameters": {"a": tru}}',
        calls(("f", "{}")),
    ),
    ("Sure. " + llama("f", "{}"), "Sure. " + llama("f", "{}"), []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("Hello {", "Hello {", []),
    ("", "", []),
]

LLAMA_MALFORMED = [
    llama("f", '{"a": tru}'),
    '{"parameters": {}}',
    '{"name": "f"}',
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {}, "extra": 1}',
    '{"name": "f", "parameters": {"a": 1}',  # unterminated
    '{"name": "f", "para',
    "{not json}",
]


@pytest.mark.parametrize("text, content, tool_calls", LLAMA_CASES)
def test_llama3_json_parse(text, content, tool_calls):
    assert Llama3JsonToolParser(None).parse(text) == ParsedToolCalls(content, tool_calls)


@pytest.mark.parametrize("text", LLAMA_MALFORMED)
def test_llama3_json_malformed_call_is_content(text):
    assert Llama3JsonToolParser(None).parse("\n<|python_tag|>" + text) == ParsedToolCalls(
        "<|python_tag|>" + text, []
    )


def test_arguments_stream_as_they_arrive_and_a_partial_tag_waits():
    parser = HermesToolParser(None)
    first = parser.feed('Hi <tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert first.content == "Hi" and [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "f", '{"city": "Pa')
    ]
    assert parser.feed('ris"}}\n</tool').tool_calls[0].arguments == 'ris"}'
    assert parser.feed("_call> and <tool").content == "  and"  # the space after "Hi" was held back
    assert parser.feed("box>").content == " <toolbox>"
    assert parser.finish().tool_calls == []


def test_llama3_json_streams_arguments_before_the_call_ends():
    parser = Llama3JsonToolParser(None)
    assert parser.feed("<|python_tag|>").content == ""
    msg = parser.feed('{"name": "f", "parameters": {"a": [1, ')
    assert [(d.name, d.arguments) for d in msg.tool_calls] == [("f", '{"a": [1, ')]


def test_a_long_call_streams_in_linear_time():
    args = json.dumps({f"k{i}": 'v {} \\ " ' * 3 for i in range(2000)})
    text = hermes("f", args)
    start = time.perf_counter()
    got = stream(HermesToolParser, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert got.tool_calls == calls(("f", args)) and time.perf_counter() - start < 2.0


# Texts on which streaming must equal parse: every piece is whole, or fails before its arguments open.
HERMES_PIECES = [
    hermes("get_weather", '{"city": "Paris"}'),
    hermes("f", TRICKY_ARGS, ws=""),
    hermes("g", END_TAG_ARGS, ws=" \n"),
    "Sure, let me check. ",
    "\n\n",
    " <tool",
    "<tool_call",
    "</tool_call>",
    "{",
    "}",
    '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
    "<tool_call>oops",
]
HERMES_ENDINGS = ["", "<tool_call>", "<tool_c", '<tool_call>\n{"name": "f", "argu', '<tool_call>{"name": "f']

LLAMA_CALLS = [
    llama("get_weather", '{"city": "Paris"}'),
    llama("f", TRICKY_ARGS, "arguments"),
    llama("g", "{}"),
]
LLAMA_ENDINGS = [
    "",
    "\n",
    " done",
    "; ",
    ";",
    '; {"name": 1}',
    '; {"name": "f", "parameters": "x"}',
    '; {"na',
]


def hermes_texts() -> st.SearchStrategy[str]:
    body = st.lists(st.sampled_from(HERMES_PIECES), max_size=6).map("".join)
    return st.builds(str.__add__, body, st.sampled_from(HERMES_ENDINGS))


def llama_texts() -> st.SearchStrategy[str]:
    lead = st.sampled_from(["", "  ", "<|python_tag|>", "\n<|python_tag|> ", "<|python"])
    sep = st.sampled_from([";", "; ", " ;\n"])
    body = st.builds(lambda cs, s: s.join(cs), st.lists(st.sampled_from(LLAMA_CALLS), max_size=3), sep)
    plain = st.sampled_from(["Hello", "Sure {", " ", '{"name": "f", "param', "{x}"])
    return st.one_of(st.builds(lambda *p: "".join(p), lead, body, st.sampled_from(LLAMA_ENDINGS)), plain)


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(set(points)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


PARSERS = [(HermesToolParser, hermes_texts()), (Llama3JsonToolParser, llama_texts())]


@pytest.mark.parametrize("cls, texts", PARSERS, ids=["hermes", "llama3_json"])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streaming_equals_parse_however_the_text_is_cut(cls, texts, data):
    text = data.draw(texts)
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert stream(cls, cut(text, points)) == cls(None).parse(text)


# A call that goes wrong after its arguments began streaming: parse makes it content, the stream has given
# it out already and keeps it; what the stream gives still does not depend on the cuts.
LATE_FAILURES = [
    (
        HermesToolParser,
        'A <tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call> B ' + hermes("g", "{}"),
        ['A <tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call> B', ("g", "{}")],
        ["A } junk</tool_call> B", ("f", '{"a": 1}'), ("g", "{}")],
    ),
    (HermesToolParser, 'A <tool_call>{"name": "f", "arguments": {"a": "b', [None], ["A", ("f", '{"a": "b')]),
    (HermesToolParser, hermes("f", '{"a": tru}'), [None], ["", ("f", '{"a": tru}')]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {}, "x": 1}', [None], [', "x": 1}', ("f", "{}")]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": 1', [None], ["", ("f", '{"a": 1')]),
]


@pytest.mark.parametrize("cls, text, parsed, streamed", LATE_FAILURES)
def test_a_call_that_fails_after_its_arguments_opened(cls, text, parsed, streamed):
    content = text if parsed[0] is None else parsed[0]
    assert cls(None).parse(text) == ParsedToolCalls(content, calls(*parsed[1:]))
    want = ParsedToolCalls(streamed[0], calls(*streamed[1:]))
    for size in (len(text), 1, 2, 5):
        assert stream(cls, [text[i : i + size] for i in range(0, len(text), size)]) == want


REQUIRED_CASES = [
    ('[{"name": "f", "parameters": {"a": 1}}]', "", calls(("f", '{"a": 1}'))),
    (
        '[ {"name": "f", "parameters": {}} ,\n{"name": "g", "parameters": {"b": "]"}}]',
        "",
        calls(("f", "{}"), ("g", '{"b": "]"}')),
    ),
    ('[{"name": "f", "parameters": {"a": "x', "", calls(("f", '{"a": "x'))),  # cut in the arguments
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g', ', {"name": "g', calls(("f", '{"a": 1}'))),
    ('[{"name": "f", "param', '[{"name": "f", "param', []),  # cut before the arguments opened
    ("[", "[", []),
]


@pytest.mark.parametrize("text, content, tool_calls", REQUIRED_CASES)
def test_required_calls_keep_a_cut_call_and_no_text_vanishes(text, content, tool_calls):
    want = ParsedToolCalls(content, tool_calls)
    for size in (len(text), 1, 3):
        assert stream(RequiredCalls, [text[i : i + size] for i in range(0, len(text), size)]) == want


def required_texts() -> st.SearchStrategy[str]:
    """tool_choice "required" outputs: a JSON list of calls, laid out as a JSON writer may."""
    args = st.sampled_from(['{"city": "Paris"}', TRICKY_ARGS, END_TAG_ARGS, "{}"])
    listed = st.lists(st.tuples(st.sampled_from(["get_weather", "f"]), args), min_size=1, max_size=3)
    layout = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}])
    dump = lambda cs, kw: json.dumps([{"name": n, "parameters": json.loads(a)} for n, a in cs], **kw)
    return st.builds(dump, listed, layout)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_required_calls_stream_as_written_and_a_cut_list_gives_its_calls_so_far(data):
    text = data.draw(required_texts())
    whole = stream(RequiredCalls, [text])
    assert whole.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        (c["name"], c["parameters"]) for c in json.loads(text)
    ]
    assert (
        stream(RequiredCalls, cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=12)))) == whole
    )
    prefix = text[: data.draw(st.integers(0, len(text)))]  # an output cut at max_tokens
    got = stream(RequiredCalls, [prefix]).tool_calls
    assert all(g == w for g, w in zip(got[:-1], whole.tool_calls))  # the calls before the cut one, whole
    assert all(
        g.name == w.name and w.arguments.startswith(g.arguments) for g, w in zip(got, whole.tool_calls)
    )
    if not got:
        assert stream(RequiredCalls, [prefix]).content == prefix.strip()


def test_builtin_parsers_come_through_the_entry_point(plugin_manager):
    assert plugin_manager.infos["tool_parsers"].hooks == ["turnout_tool_parsers"]
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert {"hermes", "llama3_json"} <= set(tool_parser_names())


def test_unknown_parser_names_the_installed_ones(plugin_manager):
    with pytest.raises(ConfigError, match="unknown tool-call parser 'nope'; installed: ") as e:
        get_tool_parser("nope")
    assert "hermes" in str(e.value) and "llama3_json" in str(e.value) and "\n" not in str(e.value)


class _Mine(ToolParser):
    name = "mine"


class _FakeHermes(ToolParser):
    name = "hermes"


class _Parsers:
    @hookimpl
    def turnout_tool_parsers(self):
        return [_Mine, _FakeHermes]


def test_a_plugin_adds_a_parser_and_a_duplicate_name_keeps_the_first(register_plugin, caplog):
    register_plugin(_Parsers(), "myparsers")
    with caplog.at_level(logging.WARNING, logger="turnout"):
        assert get_tool_parser("mine") is _Mine
    assert get_tool_parser("hermes") is HermesToolParser
    assert any("'hermes' ignored" in r.getMessage() and "myparsers" in r.getMessage() for r in caplog.records)
