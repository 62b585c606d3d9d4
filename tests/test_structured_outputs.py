"""Structured outputs, checked by what a user checks: the output parses and validates against its JSON
schema (the `jsonschema` library), matches its regex, is one of its choices. A real server on 127.0.0.1
spoken to by the official `openai` client, and LLM.generate in-process."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
from test_server import Server

from turnout import LLM, SamplingParams, hookimpl
from turnout.errors import ConfigError
from turnout.structured_outputs import Grammar, StructuredOutputBackend, StructuredOutputsParams

openai = pytest.importorskip("openai")

MODEL = "agent"  # the agent_server fixture's served model name
NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}},
        "required": ["scores"],
    },
    {
        "type": "object",
        "properties": {"person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["name", "age"]}},
        "required": ["person"],
    },
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -50, "maximum": 50}}, "required": ["t"]},
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "high"]}, "value": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["level", "value"],
    },
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "why": NAME}, "required": ["answer", "why"]},
    {
        "type": "object",
        "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]}, "minItems": 1, "maxItems": 2}},
        "required": ["points"],
    },
    {"type": "object", "properties": {"title": NAME, "draft": {"type": "boolean"}}, "required": ["title", "draft"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}, "unit": {"const": "kg"}}, "required": ["n", "unit"]},
    {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"enum": [1, 2, 3]}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"],
    },
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"]},
    {"type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["day", "hour"]},
    {"type": "object", "properties": {"names": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2}}, "required": ["names"]},
]  # fmt: skip


@pytest.fixture
def server(agent_server: Server) -> Server:
    return agent_server


def _ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with one JSON object for this schema: {json.dumps(schema)}"}]


async def _json_schema_answers(
    server: Server, at_once: bool, schemas: list[dict] = SCHEMAS
) -> list[tuple[dict, str, str]]:
    """Each schema asked without and with streaming (in that order): all at once, or one after another."""
    client = server.aclient()

    async def one(i: int, schema: dict, stream: bool) -> tuple[dict, str, str]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        kw = dict(model=MODEL, messages=_ask(schema), response_format=fmt, temperature=0, max_tokens=160)
        if not stream:
            r = await client.chat.completions.create(**kw)
            return schema, r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for ch in await client.chat.completions.create(**kw, stream=True):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return schema, text, finish

    asks = [(i, s, stream) for i, s in enumerate(schemas) for stream in (False, True)]
    if at_once:
        return await asyncio.gather(*(one(*a) for a in asks))
    return [await one(*a) for a in asks]


@pytest.mark.slow
def test_json_schema_outputs_validate_streamed_and_not(server: Server) -> None:
    answers = asyncio.run(_json_schema_answers(server, at_once=True))
    for schema, text, finish in answers:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    # Greedy, the stream says what the whole answer says. Each pair runs alone on the prompt the first pass
    # cached, so both compute alike: a CPU matmul's bits depend on the rows batched beside a token's. The
    # schemas whose answers are longest and most nested (integer arrays, objects in objects and in arrays,
    # a pattern): one request at a time costs 0.65 s each.
    alone = asyncio.run(_json_schema_answers(server, False, [SCHEMAS[i] for i in (6, 7, 9, 13, 16)]))
    pairs = [(whole[1], streamed[1]) for whole, streamed in zip(alone[::2], alone[1::2])]
    assert all(whole == streamed for whole, streamed in pairs), [p for p in pairs if p[0] != p[1]]


def test_json_object_choice_and_regex(server: Server) -> None:
    client = server.client()
    ask = [{"role": "user", "content": "Is a turnout a railway switch?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=64)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=MODEL, messages=ask, temperature=1.0, n=4, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "not sure"]}})  # fmt: skip
    assert all(c.message.content in ("yes", "no", "not sure") for c in r.choices)
    pattern = r"[A-Z][a-z]{2,6} [0-9]{2}"
    r = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20, temperature=1.0, n=3,
                                  extra_body={"structured_outputs": {"regex": pattern}})  # fmt: skip
    assert all(re.fullmatch(pattern, c.text) for c in r.choices), [c.text for c in r.choices]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_with_openai_s_body(server: Server, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err
    ok = server.client().chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # the server is unharmed


# ---- in-process: LLM.generate ----
def test_llm_generate_holds_to_the_constraint_and_rejects_a_bad_one(hermes_smol: Path) -> None:
    llm = LLM(model=str(hermes_smol), max_model_len=512, cpu_kv_cache_bytes=32 << 20)
    try:
        schema = SCHEMAS[7]
        so = StructuredOutputsParams(json=schema)
        out = llm.chat(
            _ask(schema), SamplingParams(temperature=0, max_tokens=96, structured_outputs=so), use_tqdm=False
        )
        jsonschema.validate(json.loads(out[0].outputs[0].text), schema)
        bad = SamplingParams(structured_outputs={"json": {"type": "bogus"}})
        with pytest.raises(ValueError, match="does not compile"):
            llm.generate(["a", "b"], [SamplingParams(), bad])
        assert not llm.engine.has_unfinished()  # nothing was queued
    finally:
        llm.shutdown()


def test_a_constrained_request_leaves_its_neighbours_tokens_alone(tiny_llama: Path) -> None:
    """Word-level tokens: "w7" is one token, so the regex picks words."""
    llm = LLM(model=str(tiny_llama), cpu_kv_cache_bytes=16 << 20, block_size=8)
    try:
        prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 24)]
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        so = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "(w7|w9)+"})
        alone = llm.generate(prompts, [greedy] * 21, use_tqdm=False)
        beside = llm.generate(prompts, [so] + [greedy] * 20, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in beside[1:]] == [o.outputs[0].token_ids for o in alone[1:]]
        assert re.fullmatch("(w7|w9)+", beside[0].outputs[0].text.replace(" ", ""))
        assert beside[0].outputs[0].token_ids != alone[0].outputs[0].token_ids
    finally:
        llm.shutdown()


class ChoiceTrie(StructuredOutputBackend):
    """A third party's backend through the hook: `choice` only, as a walk over the choices' token ids."""

    name = "trie"

    def compile(self, kind: str, spec: str) -> list[list[int]]:
        if kind != "choice":
            raise ValueError(f"trie compiles choice only, not {kind}")
        return [self.tokenizer.encode(c, add_special_tokens=False) for c in json.loads(spec)]

    def matcher(self, compiled: list[list[int]]) -> Grammar:
        return TrieWalk(compiled, self.eos_token_ids)


class TrieWalk(Grammar):
    def __init__(self, choices: list[list[int]], eos: list[int]) -> None:
        self.choices, self.eos, self.out, self.done = choices, eos, [], False

    def allowed(self) -> set[int]:
        n = len(self.out)
        nxt = {c[n] for c in self.choices if c[:n] == self.out and len(c) > n}
        return nxt | (set(self.eos) if self.out in self.choices else set())

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed():
            return False
        self.done = token_id in self.eos
        self.out.append(token_id)
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed():
            bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)

    def is_terminated(self) -> bool:
        return self.done


@hookimpl
def turnout_structured_output_backends() -> list[type[StructuredOutputBackend]]:
    return [ChoiceTrie]


def test_a_plugin_backend_serves_the_constraints_it_compiles(tiny_llama: Path, register_plugin) -> None:
    register_plugin(sys.modules[__name__], "trie_plugin")
    llm = LLM(model=str(tiny_llama), cpu_kv_cache_bytes=16 << 20, structured_outputs_backend="trie")
    try:
        so = StructuredOutputsParams(choice=["w5 w7 w11", "w9"])
        outs = llm.generate(
            ["w1 w2"] * 4, SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=8, structured_outputs=so)
        )
        assert {o.text for out in outs for o in out.outputs} <= {"w5 w7 w11", "w9"}
        with pytest.raises(ValueError, match="trie compiles choice only"):
            llm.generate(["w1"], SamplingParams(structured_outputs={"regex": "w1+"}))
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match="structured_outputs_backend 'nope'"):
        LLM(model=str(tiny_llama), cpu_kv_cache_bytes=16 << 20, structured_outputs_backend="nope")
