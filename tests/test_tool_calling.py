"""Tool calling through `turnout serve` and the official `openai` client: tool_choice "auto" (the hermes
parser), "required", a named function and "none"; streamed deltas reassemble into the same calls; the
arguments validate against the tool's parameters (`jsonschema`). The model is the embedded SmolLM2 with a
Hermes-style chat template (its own has no tools): see the hermes_smol fixture."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import pytest
from test_server import Server

openai = pytest.importorskip("openai")

MODEL = "agent"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# Makes the model write a Hermes call, as a model trained for tools would: the parser reads what it wrote.
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,10}", "unit": "c"\}\}\n</tool_call>'


def _create(server: Server, stream: bool, **kw):
    """(content, calls, finish_reason); a call is (name, arguments, id, the deltas its arguments came in)."""
    client = server.client()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=96) | kw
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments, t.id, 1) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    content, calls, finish = "", {}, None
    for i, ch in enumerate(client.chat.completions.create(**kw, stream=True)):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        assert i == 0 or d.content or d.tool_calls or ch.choices[0].finish_reason, ch  # no empty chunks
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.index not in calls:
                assert t.id and t.function.name, t  # a call's first delta names it
                calls[t.index] = [t.function.name, "", t.id, 0]
            calls[t.index][1] += t.function.arguments or ""
            calls[t.index][3] += 1
        finish = ch.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def _valid(calls: list[tuple]) -> None:
    assert calls
    for name, arguments, call_id, _ in calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])
        assert call_id.startswith("call_")


@pytest.mark.parametrize(
    "tool_choice, extra, cut",
    [
        ("auto", {"structured_outputs": {"regex": HERMES_CALL}}, 22),
        ("required", {}, 16),
        ({"type": "function", "function": {"name": "get_time"}}, {}, 5),
    ],
    ids=["auto", "required", "named"],
)
@pytest.mark.slow
def test_tool_calls_validate_and_stream_into_the_same_calls(
    agent_server: Server, tool_choice, extra, cut: int
) -> None:
    """Whole and streamed calls agree, the streamed arguments arriving in pieces as they are generated;
    `cut` tokens end the output inside the arguments, where both answers give the partial call with
    finish_reason "length"."""
    whole = _create(agent_server, False, tool_choice=tool_choice, extra_body=extra)
    streamed = _create(agent_server, True, tool_choice=tool_choice, extra_body=extra)
    for content, calls, finish in (whole, streamed):
        assert finish == "tool_calls" and not content, (content, calls)
        _valid(calls)
    strip_ids = lambda calls: [c[:2] for c in calls]
    assert strip_ids(streamed[1]) == strip_ids(whole[1])
    assert all(c[3] > 1 for c in streamed[1]), streamed
    if isinstance(tool_choice, dict):
        assert [c[0] for c in whole[1]] == ["get_time"]
    if tool_choice == "auto":
        assert json.loads(whole[1][0][1])["unit"] == "c"
    complete = whole[1][0][:2]
    cut_calls = []
    for stream in (False, True):
        content, calls, finish = _create(
            agent_server, stream, tool_choice=tool_choice, extra_body=extra, max_tokens=cut
        )
        assert finish == "length" and not content and len(calls) == 1, (content, calls)
        cut_calls += strip_ids(calls)
    (name, partial), streamed_cut = cut_calls
    assert streamed_cut == (name, partial) and name == complete[0], (cut_calls, complete)
    assert complete[1].startswith(partial) and partial != complete[1], (partial, complete)


@pytest.mark.slow
def test_tool_choice_none_never_calls(agent_server: Server) -> None:
    for stream in (False, True):
        content, calls, finish = _create(
            agent_server,
            stream,
            tool_choice="none",
            extra_body={"structured_outputs": {"regex": HERMES_CALL}},
        )
        assert calls == [] and finish == "stop" and content.startswith("<tool_call>")


def test_a_conversation_with_calls_and_results_renders_through_the_template(
    agent_server: Server, hermes_smol
) -> None:
    from transformers import AutoTokenizer

    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    r = agent_server.client().chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    rendered = [dict(m) for m in messages]
    rendered[1] = {
        **messages[1],
        "content": "",
        "tool_calls": [
            {
                **messages[1]["tool_calls"][0],
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            }
        ],
    }
    tok = AutoTokenizer.from_pretrained(hermes_smol)
    text = tok.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
    ids=["unknown-function", "duplicate-name", "no-tools", "two-constraints", "bad-parameters"],
)
def test_bad_tool_requests_are_400s(agent_server: Server, body: dict, param: str) -> None:
    r = agent_server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


@pytest.mark.slow
def test_an_unknown_parser_or_auto_without_one_is_one_line_at_start_up() -> None:
    for flags, says in (
        (["--tool-call-parser", "nope"], "unknown tool-call parser 'nope'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "turnout.cli", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2 and says in p.stderr and "hermes" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_tool_call_answers_validate_against_the_openapi_document(agent_server: Server) -> None:
    from test_openapi import sse_events, validate_response

    doc = httpx.get(f"{agent_server.url}/openapi.json", timeout=10).json()
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 64,
        "temperature": 0,
    }
    r = agent_server.post("/v1/chat/completions", body)
    assert r.json()["choices"][0]["message"]["tool_calls"], r.text
    validate_response(doc, "/v1/chat/completions", "post", 200, "application/json", r.json())
    r = agent_server.post(
        "/v1/chat/completions",
        {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "stream": True},
    )
    chunks = sse_events(r)
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    for c in chunks:
        validate_response(doc, "/v1/chat/completions", "post", 200, "text/event-stream", c)
