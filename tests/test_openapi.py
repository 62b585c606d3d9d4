"""/openapi.json: it describes every body, real answers validate against it, and a bounded fuzz of a real
server driven by it (schemathesis, positive and negative cases) gets no 5xx and no hang."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from test_server import KEY, TINY, Server

from turnout.entrypoints.openai.protocol import INT64_MAX
from turnout.entrypoints.openai.serving_chat import ROLES

from fuzzing import fuzz

MAX_LEN = 64
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
TEMPLATE += "{% if add_generation_prompt %}assistant{% endif %}"


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """The tiny random llama with a chat template (links to its files), so chat requests reach the engine."""
    dst = tmp_path_factory.mktemp("chat_llama")
    for f in tiny_llama.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "chat_template.jinja").write_text(TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, chat_llama: Path):
    s = Server(tmp_path_factory.mktemp("openapi"), str(chat_llama), *TINY, "--max-model-len", str(MAX_LEN),
               "--api-key", KEY)  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def doc(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json", timeout=10).json()


def _refs(node: Any) -> list[str]:
    """Every $ref below node, and every discriminator mapping's target."""
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    if isinstance(node.get("discriminator"), dict):
        own += node["discriminator"].get("mapping", {}).values()
    return own + [r for v in node.values() for r in _refs(v)]


def _pointer(*keys: str) -> str:
    return "#/" + "/".join(str(k).replace("~", "~0").replace("/", "~1") for k in keys)


def validate_response(
    doc: dict[str, Any], path: str, method: str, status: int, media: str, body: Any
) -> None:
    """body against the document's schema of that response, its $refs resolved in the document."""
    registry = Registry().with_resource("urn:doc", DRAFT202012.create_resource(doc))
    where = _pointer("paths", path, method, "responses", str(status), "content", media, "schema")
    jsonschema.Draft202012Validator({"$ref": f"urn:doc{where}"}, registry=registry).validate(body)


# ---- the document ----
GENERATION = {  # path: request model, some of its fields, response model, stream chunk model
    "/v1/completions": (
        "CompletionRequest",
        {"prompt", "max_tokens", "stop_token_ids", "response_format", "structured_outputs"},
        "CompletionResponse",
        "CompletionStreamResponse",
    ),
    "/v1/chat/completions": (
        "ChatCompletionRequest",
        {"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs"},
        "ChatCompletionResponse",
        "ChatCompletionStreamResponse",
    ),
}


def test_document_is_valid_openapi_3_1_and_its_refs_resolve(doc: dict[str, Any]) -> None:
    assert doc["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(json.loads(json.dumps(doc))).validate()  # the OpenAPI 3.1 meta-schema
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs = set(_refs(doc))
    assert refs and all(r.startswith("#/components/schemas/") for r in refs), refs
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(schemas), sorted(refs)


def test_document_describes_every_body(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    ops = {(path, method): op for path, item in doc["paths"].items() for method, op in item.items()}
    assert set(ops) == {
        ("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
        ("/health", "get"), ("/version", "get"), ("/metrics", "get"), ("/v1/explain", "get"),
    }  # fmt: skip

    def ref(content: dict[str, Any]) -> str:
        return content["schema"]["$ref"].rsplit("/", 1)[1]

    for path, (request, fields, body, chunk) in GENERATION.items():
        op = ops[path, "post"]
        assert (
            op["requestBody"]["required"] and ref(op["requestBody"]["content"]["application/json"]) == request
        )
        assert (
            fields <= set(schemas[request]["properties"])
            and schemas[request]["additionalProperties"] is False
        )
        ok = op["responses"]["200"]["content"]
        assert ref(ok["application/json"]) == body
        events = [x["$ref"].rsplit("/", 1)[1] for x in ok["text/event-stream"]["schema"]["anyOf"]]
        assert events == [chunk, "ErrorResponse"]
        for status in ("400", "401", "404", "413", "422", "503"):
            assert ref(op["responses"][status]["content"]["application/json"]) == "ErrorResponse", status
    assert ref(ops["/v1/models", "get"]["responses"]["200"]["content"]["application/json"]) == "ModelList"
    assert ref(ops["/version", "get"]["responses"]["200"]["content"]["application/json"]) == "VersionResponse"
    explain = ops["/v1/explain", "get"]["responses"]["200"]["content"]["application/json"]
    assert ref(explain) == "ExplainResponse"
    assert ref(ops["/health", "get"]["responses"]["503"]["content"]["application/json"]) == "ErrorResponse"
    message = schemas["ChatCompletionMessage"]["properties"]
    assert "tool_calls" in message and "tool_calls" in schemas["ChatDelta"]["properties"]
    assert "tool_calls" in json.dumps(schemas["ChatCompletionChoice"]["properties"]["finish_reason"])
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    prompt = json.dumps(schemas["CompletionRequest"]["properties"]["prompt"])
    assert f'"maximum": {INT64_MAX}' in prompt and '"minimum": 0' in prompt


def sse_events(r: httpx.Response) -> list[Any]:
    events = [line[len("data: ") :] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]", r.text
    return [json.loads(e) for e in events[:-1]]


CHAT = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3}


def test_real_answers_validate_against_the_document(server: Server, doc: dict[str, Any]) -> None:
    posts = [  # (path, body, status)
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "logprobs": 2, "n": 2}, 200),
        ("/v1/completions", {"prompt": ["w5", "w7 w8"], "max_tokens": 2, "stop": ["w9"]}, 200),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, 200),
        ("/v1/chat/completions", {**CHAT, "n": 2, "seed": 7, "temperature": 1.0}, 200),
        ("/v1/completions", b'{"prompt": ', 400),
        ("/v1/completions", {"prompt": [2**64]}, 400),
        ("/v1/completions", {"prompt": "w1", "model": "gpt-4"}, 404),
        ("/v1/completions", {"prompt": list(range(1, MAX_LEN + 5))}, 413),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "3"}, 422),
        ("/v1/chat/completions", {**CHAT, "bogus": 1}, 422),
    ]
    for path, body, status in posts:
        r = server.post(path, body)
        assert r.status_code == status, (body, r.text)
        validate_response(doc, path, "post", status, "application/json", r.json())
    streams = [
        ("/v1/completions", {"prompt": [5], "max_tokens": 3, "logprobs": 1}),
        ("/v1/chat/completions", CHAT),
    ]
    for path, body in streams:
        r = server.post(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        chunks = sse_events(r)
        assert chunks[-1]["usage"] and not chunks[-1]["choices"]
        for c in chunks:
            validate_response(doc, path, "post", 200, "text/event-stream", c)
    r = server.post("/v1/completions", {"prompt": "w1"}, key="wrong")
    assert r.status_code == 401
    validate_response(doc, "/v1/completions", "post", 401, "application/json", r.json())
    for path in ("/v1/models", "/version"):
        r = httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10)
        assert r.status_code == 200
        validate_response(doc, path, "get", 200, "application/json", r.json())
    with pytest.raises(jsonschema.ValidationError):  # the schemas do say something
        validate_response(
            doc, "/v1/models", "get", 200, "application/json", {"object": "list", "data": [{"id": 5}]}
        )


# ---- integers too wide for the engine: a 400 that names the field, never a 500 (or a hang, for n) ----
WIDE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": 2**70}}}
WIDE_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"x": [2**64]}}}
WIDE = [  # (path, body, param)
    ("/v1/completions", {"prompt": [2**64]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2**70]]}, "prompt"),
    ("/v1/completions", {"prompt": [5], "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [5], "top_k": 2**64}, "top_k"),
    ("/v1/completions", {"prompt": [5], "n": 2**64}, "n"),  # was 2**64 engine requests: a hang
    ("/v1/completions", {"prompt": [5], "n": 2, "seed": 2**64 - 1}, "seed"),  # seeds seed, seed+1 = 2**64
    ("/v1/completions", {"prompt": [5], "max_tokens": -(2**70)}, "max_tokens"),
    ("/v1/completions", {"prompt": [5], "logprobs": 2**64}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**64}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2**64, "logprobs": True}, "top_logprobs"),
    (
        "/v1/completions",
        {"prompt": "w5", "response_format": WIDE_SCHEMA},
        "response_format.json_schema.schema",
    ),
    (
        "/v1/completions",
        {"prompt": "w5", "structured_outputs": {"json": {"maxLength": 2**64}}},
        "structured_outputs.json",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [WIDE_TOOL], "tool_choice": "required"},
        "tools.0.function.parameters",
    ),
]


def test_integers_beyond_64_bits_are_a_400_naming_the_field(server: Server) -> None:
    mark = len(server.log.read_text())
    for path, body, param in WIDE:
        r = server.post(path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", param), err
        assert param.split(".")[0] in err["message"], err
    ok = server.post("/v1/completions", {"prompt": [5], "n": 2, "seed": INT64_MAX, "top_k": INT64_MAX})
    assert ok.status_code == 200, ok.text  # the widest integers the engine takes
    r = server.post("/v1/completions", {"prompt": [INT64_MAX]})
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    )  # the vocabulary's check, as before
    assert "Traceback" not in server.log.read_text()[mark:]


# ---- the fuzz ----
EXAMPLES = 150
TIMEOUT = 15.0  # seconds for one answer: a request of a few tokens takes milliseconds


def _cheap(body: Any) -> Any:
    """A generated body made cheap to run: in-range max_tokens and n become small; the rest, out-of-range
    values and wrong types included, stays as generated. Most generated roles become real ones, so that
    chat requests get past the role check to the template and the engine."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, small in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2)):
        if type(body.get(key)) is int and small < body[key] <= MAX_LEN:
            body[key] = small
    if isinstance(body.get("messages"), list):
        body["messages"] = [_real_role(m) for m in body["messages"]]
    return body


def _real_role(m: Any) -> Any:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] in ROLES:
        return m
    i = len(m["role"]) % (len(ROLES) + 1)  # one in six keeps its made-up role
    return m if i == len(ROLES) else {**m, "role": ROLES[i]}


@pytest.mark.slow
def test_fuzz_from_the_document_gets_no_5xx_and_no_hang(server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    cases = st.one_of(
        [schema[path]["POST"].as_strategy(generation_mode=mode) for path in GENERATION for mode in modes]
    )
    seen: dict[int, int] = {}

    @fuzz(EXAMPLES)
    @given(case=cases)
    def run(case: Any) -> None:
        case.body = _cheap(case.body)
        r = case.call(base_url=server.url, headers=AUTH, timeout=TIMEOUT)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{case.method} {case.path} {json.dumps(case.body)[:2000]}\n{r.text}"

    t0, mark = time.monotonic(), len(server.log.read_text())
    run()
    took = time.monotonic() - t0
    print(f"fuzz: {sum(seen.values())} requests in {took:.1f}s; statuses {sorted(seen.items())}")
    assert seen.get(200), seen  # some requests did run
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "Traceback" not in server.log.read_text()[mark:]


# ---- found by the fuzz: a grammar the vocabulary cannot spell ----
def test_a_grammar_the_vocabulary_cannot_spell(server: Server) -> None:
    """The tiny vocabulary is whole words "w0".."w508": "ab" cannot start, "w1ab" dead-ends after "w1"."""
    body = {"prompt": [94, 0, 288], "logprobs": 1, "temperature": 0, "max_tokens": 4}
    r = server.post("/v1/completions", {**body, "structured_outputs": {"choice": ["ab"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "cannot be spelled" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {**body, "structured_outputs": {"choice": ["w1ab"]}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "w1" and choice["finish_reason"] == "stop"
    assert all(math.isfinite(x) for x in choice["logprobs"]["token_logprobs"])
