"""`turnout serve` as a user runs it: a real server on 127.0.0.1 in a subprocess, spoken to by the official
`openai` client (and raw httpx where the bytes matter). Outputs are checked against LLM.generate."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from turnout import LLM, SamplingParams

from procs import alive

openai = pytest.importorskip("openai")

KEY = "sk-turnout-test"
SMOL = ["--max-model-len", "512", "--cpu-kv-cache-bytes", str(64 << 20), "--api-key", KEY]
TINY = ["--cpu-kv-cache-bytes", str(16 << 20), "--block-size", "8"]


def survivors(pids: list[int], within: float = 10.0) -> list[str]:
    """The pids still running after `within` seconds, with their command lines."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    out = []
    for p in pids:
        if alive(p):
            try:
                cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                out.append(f"{p}: {cmdline}")
            except OSError:
                pass
    return out


def _parents() -> dict[int, int]:
    """pid -> parent pid, of every process."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return parent


def _spawned(pid: int) -> bool:
    """Started by multiprocessing's spawn (the engine core, a multiproc worker)."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class Server:
    """`turnout serve ... --port 0` in a subprocess; the port comes from its start-up line."""

    def __init__(self, tmp: Path, *args: str, wait: bool = True, env: dict | None = None) -> None:
        self.log = tmp / "server.log"
        cmd = [sys.executable, "-m", "turnout.cli", "serve", *args, "--port", "0"]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 240) -> None:
        self.url = self._ready_url(timeout)

    def _ready_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log.read_text()}"
            if m := re.search(r"serving .*; (http://127\.0\.0\.1:\d+)/v1", self.log.read_text()):
                try:
                    if httpx.get(f"{m[1]}/health", timeout=5).status_code == 200:
                        return m[1]
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log.read_text()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body: bytes | dict, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("turnout:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[re.sub(r"\{.*\}", "", name) if "finished_reason" not in name else name] = float(value)
        return out

    def wait_metrics(self, ok, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while not ok(m := self.metrics()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return m

    def descendants(self, root: int | None = None) -> list[int]:
        """Every process below root (default: the server), at any depth."""
        parent = _parents()
        out, frontier = [], [root or self.proc.pid]
        while frontier:
            kids = [p for p, pp in parent.items() if pp in frontier]
            out += kids
            frontier = kids
        return out

    def engine_core(self) -> int:
        """The pid of the engine-core process: the server's one spawned child."""
        parent = _parents()
        cores = [p for p, pp in parent.items() if pp == self.proc.pid and _spawned(p)]
        assert len(cores) == 1, f"engine core processes {cores}:\n{self.log.read_text()}"
        return cores[0]

    def stop(self, timeout: float = 60) -> float:
        """SIGTERM; seconds until exit."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"no exit {timeout}s after SIGTERM:\n{self.log.read_text()}") from None
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    server = Server(tmp_path_factory.mktemp("smol"), *SMOL, wait=False)
    try:
        request.getfixturevalue("refs")  # computed while the server starts
        server.wait_ready()
        yield server
    finally:
        server.stop()


PROMPTS = ["The capital of France is", "Railway switches are"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a turnout?"}]


@pytest.fixture(scope="module")
def refs() -> dict:
    """Every LLM.generate reference of the embedded-model tests (one model load), each run alone as the server
    runs these requests: in bf16, oneDNN's matmul rounds a one-row batch (one request decoding) differently
    from a larger one, so a batched reference can differ from the server at a near-tied token."""
    llm = LLM(max_model_len=512, cpu_kv_cache_bytes=64 << 20)
    tok = llm.tokenizer
    chat = tok.encode(
        tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    jobs = {  # name: (prompt, max_tokens, ignore_eos)
        "p0": (PROMPTS[0], 12, False),
        "p1": (PROMPTS[1], 12, False),
        "chat": (chat, 16, False),
        "stop": (PROMPTS[1], 20, True),
        "neighbour": (PROMPTS[0], 24, True),
    }
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=e) for _, m, e in jobs.values()]
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for (p, _, _), sp in zip(jobs.values(), sps)]
    llm.shutdown()
    return {"tokenizer": tok, "chat_ids": chat, **dict(zip(jobs, outs))}


# ---- completions and chat ----
def test_completion_greedy_matches_llm_generate(smol: Server, refs: dict) -> None:
    ref, tok = [refs["p0"], refs["p1"]], refs["tokenizer"]
    client = smol.client()
    for prompt, r in zip(PROMPTS, ref):
        out = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0, logprobs=0
        )
        c = out.choices[0]
        assert c.text == r.text and c.finish_reason == r.finish_reason
        assert c.logprobs.tokens == [tok.decode([t]) for t in r.token_ids]  # token for token
        assert out.usage.prompt_tokens == len(r.prompt_token_ids)
        assert out.usage.completion_tokens == len(r.token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    ids = tok.encode(PROMPTS[0])  # token-id prompts give the same
    assert (
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=12, temperature=0)
        .choices[0]
        .text
        == ref[0].text
    )


def test_completion_stream_matches_non_stream(smol: Server) -> None:
    client = smol.client()
    kw = dict(model="SmolLM2-135M-Instruct", prompt=PROMPTS, max_tokens=10, temperature=0)
    whole = client.completions.create(**kw)
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage


def test_chat_matches_llm_generate_and_streams(smol: Server, refs: dict) -> None:
    messages, ids, ref = MESSAGES, refs["chat_ids"], refs["chat"]
    client = smol.client()
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_completion_tokens=16, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == ref.finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_sse_bytes_are_openai_s(smol: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": True}
    r = smol.post("/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_n2_and_logprobs(smol: Server) -> None:
    client = smol.client()
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPTS[0],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        logprobs=3,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 5
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert chosen <= 0 and top[tok] == chosen and 3 <= len(top) <= 4
    again = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], n=2, max_tokens=6, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeds seed, seed + 1
    greedy = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode() == t.token


def test_stop_strings_and_stop_token_ids(smol: Server, refs: dict) -> None:
    ref = refs["stop"]
    stop = ref.text[8:11]
    cut = ref.text[: ref.text.index(stop)]
    client = smol.client()
    kw = dict(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop, "@@@"]
    )
    out = client.completions.create(**kw)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == cut
    kw.update(stop=None, extra_body={"stop_token_ids": [ref.token_ids[3]], "ignore_eos": True})
    out = client.completions.create(**kw)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == ref.token_ids.index(ref.token_ids[3]) + 1


def test_models_version_health_metrics(smol: Server) -> None:
    assert [m.id for m in smol.client().models.list().data] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(f"{smol.url}/version").json()["version"]
    assert httpx.get(f"{smol.url}/health").status_code == 200  # open without the key
    smol.client().completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=2)
    m = smol.metrics()  # with a request of its own, whatever ran before
    names = """num_requests_running num_requests_waiting kv_cache_usage_perc prefix_cache_hit_rate
        prefix_cache_queries_total prefix_cache_hits_total num_preemptions_total prompt_tokens_total
        generation_tokens_total time_to_first_token_seconds_count inter_token_latency_seconds_count
        e2e_request_latency_seconds_count request_time_per_output_token_seconds_count""".split()
    for name in names:
        assert f"turnout:{name}" in m, name
    assert m["turnout:generation_tokens_total"] > 0 and m["turnout:time_to_first_token_seconds_count"] > 0


# ---- bad input ----
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD = [  # (path, body, status, param, code)
    ("/v1/completions", b'{"prompt": "x", ', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 422, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": 5}, 422, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 422, "temperature", "invalid_type"),
    ("/v1/completions", {"max_tokens": 5}, 422, "prompt", "missing_field"),
    ("/v1/completions", {"prompt": "x", "best_off": 2}, 422, "best_off", "unknown_field"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": list(range(1, 600))}, 413, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 600}, 413, "prompt", "context_length_exceeded"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w " * 600}]},
        413,
        "messages",
        "context_length_exceeded",
    ),  # fmt: skip
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_k": -3}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "x", "min_p": 2.0}, 400, "min_p", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [70000]}, 400, "prompt", None),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        None,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function"}]},
        422,
        "tools.0.function",
        "missing_field",
    ),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, 400, "tool_choice", None),
]


def _check_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err


def test_bad_requests_get_openai_errors_and_leave_neighbours_alone(smol: Server, refs: dict) -> None:
    ref = refs["neighbour"]

    async def neighbour() -> str:
        stream = await smol.aclient().completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def bad() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=smol.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            posts = [
                http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode())
                for path, body, *_ in BAD
            ]
            return await asyncio.gather(*posts)

    async def both():
        return await asyncio.gather(neighbour(), bad())

    text, responses = asyncio.run(both())
    assert text == ref.text
    for r, (_, _, status, param, code) in zip(responses, BAD):
        _check_error(r, status, param, code)
    with pytest.raises(openai.BadRequestError) as e:  # the official client raises the matching class
        smol.client().completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        smol.client().completions.create(model="nope", prompt="x")


def test_api_key(smol: Server) -> None:
    for key in (None, "wrong"):
        r = smol.post("/v1/completions", {"prompt": "x"}, key=key)
        _check_error(r, 401, None, "invalid_api_key")
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{smol.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{smol.url}/health").status_code == 200
    assert httpx.get(f"{smol.url}/metrics").status_code == 200


def test_abort_request_frees_blocks_at_once(tiny_llama: Path) -> None:
    engine = LLM(str(tiny_llama), cpu_kv_cache_bytes=1 << 22, block_size=8).engine
    bm, sp = engine.scheduler.bm, SamplingParams(max_tokens=50, ignore_eos=True)
    total = bm.num_free_blocks
    a, b = engine.add_request(list(range(5, 25)), sp), engine.add_request(list(range(30, 40)), sp)
    engine.step()
    engine.step()
    assert len(a.block_ids[0]) == 3 and len(b.block_ids[0]) == 2
    engine.abort_request(a.req_id)
    assert bm.num_free_blocks == total - 2 and a.req_id not in engine.requests and a.finish_reason == "abort"
    engine.abort_request(a.req_id)  # unknown by now: a no-op
    engine.abort_request(b.req_id)
    assert bm.num_free_blocks == total and not engine.has_unfinished()
    engine.step()  # tells the workers to drop both
    engine.shutdown()


def test_bulk_histogram_matches_prometheus_client() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from turnout.metrics import ITL_BUCKETS, BulkHistogram

    values = [0.0, 0.001, 0.0011, 0.0025, 0.3, 0.30001, 7.5, 80.0, 1e6]
    mine, ref = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("h", "doc", "m", ITL_BUCKETS, mine)
    bulk.observe_many(values[:4])
    bulk.observe_many(values[4:])
    one = Histogram("h", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=ref).labels("m")
    for v in values:
        one.observe(v)

    def series(r: CollectorRegistry) -> list[str]:
        lines = generate_latest(r).decode().splitlines()
        return [x for x in lines if x.startswith("h_") and "created" not in x]

    assert series(mine) == series(ref)


# ---- load, cancellation, back-pressure, shutdown, faults (tiny random models: the engine is fast) ----
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    """The tiny model by its positional argument, with a config file, env overrides (the API key too) and
    flags."""
    tmp = tmp_path_factory.mktemp("tiny")
    (tmp / "engine.yaml").write_text("max_model_len: 256\nblock_size: 4\n")
    args = [str(tiny_llama), "--config", str(tmp / "engine.yaml"), *TINY]
    env = {"TURNOUT_MAX_MODEL_LEN": "510", "TURNOUT_API_KEY": KEY}
    server = Server(tmp, *args, "--served-model-name", "tiny", "tiny-alias", env=env)
    yield server
    server.stop()


def test_config_precedence_and_served_names(tiny: Server) -> None:
    with pytest.raises(openai.AuthenticationError):  # TURNOUT_API_KEY guards /v1/*
        openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="wrong", max_retries=0).models.list()
    models = tiny.client().models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].max_model_len == 510  # the environment beat the file
    out = tiny.client().completions.create(model="tiny-alias", prompt=[5, 6], max_tokens=2)
    assert out.model == "tiny-alias" and out.usage.completion_tokens == 2


def test_engine_core_steps_in_a_process_of_its_own(tiny: Server) -> None:
    core = tiny.engine_core()
    assert f"engine core in a process (pid {core}); http://" in tiny.log.read_text()
    before = _cpu_ticks(core)
    out = tiny.client().completions.create(
        model="tiny", prompt=[5, 6], max_tokens=200, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 200 and _cpu_ticks(core) > before  # the steps ran there


def _cpu_ticks(pid: int) -> int:
    """User plus system CPU time of a process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j * 13) % 500 for j in range(4 + i % 9)]


async def _stream_to_end(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> str:
    """Stream request i to its end: "finished", or the error the server ended it with."""
    try:
        stream = await client.completions.create(
            model=model, prompt=_prompt(i), max_tokens=max_tokens, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            pass
        return "finished"
    except openai.APIError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.slow
def test_200_concurrent_streams_with_cancellations(tiny: Server, tiny_llama: Path) -> None:
    n = 200
    cancel = {i for i in range(n) if i % 5 == 0}
    max_tokens = {i: 300 if i in cancel else 4 + i % 5 for i in range(n)}
    ref_llm = LLM(str(tiny_llama), cpu_kv_cache_bytes=16 << 20, block_size=8)
    keep = [i for i in range(n) if i not in cancel]
    sps = [SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True) for i in keep]
    ref = dict(zip(keep, ref_llm.generate([_prompt(i) for i in keep], sps, use_tqdm=False)))
    ref_llm.shutdown()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int | None]:
        stream = await client.completions.create(
            model="tiny", prompt=_prompt(i), max_tokens=max_tokens[i], temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reason, used, chunks = "", None, None, 0
        async for chunk in stream:
            for c in chunk.choices:
                text, reason, chunks = text + c.text, c.finish_reason or reason, chunks + 1
            if chunk.usage:
                used = chunk.usage.completion_tokens
            if i in cancel and chunks == 2:
                await stream.close()  # the client goes away mid-stream
                break
        return text, reason, used

    async def run() -> list:
        client = tiny.aclient()
        return await asyncio.gather(*(one(client, i) for i in range(n)))

    before = tiny.metrics()["turnout:generation_tokens_total"]
    t0 = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - t0 < 120
    for i in keep:  # every uncancelled request: its own text, all its tokens
        assert results[i] == (ref[i].text, "length", max_tokens[i]), i
    for i in cancel:
        assert results[i][1] is None and results[i][2] is None  # it really was cut mid-stream
    m = tiny.wait_metrics(lambda m: m["turnout:num_requests_running"] == 0, timeout=10)
    assert m["turnout:num_requests_running"] == 0 and m["turnout:num_requests_waiting"] == 0
    assert m["turnout:kv_cache_usage_perc"] == 0
    assert m['turnout:request_success_total{finished_reason="length",model_name="tiny"}'] >= len(keep)
    cancelled_tokens = m["turnout:generation_tokens_total"] - before - sum(max_tokens[i] for i in keep)
    assert cancelled_tokens < len(cancel) * 300 / 2  # aborted on disconnect, not run to their end
    assert httpx.get(f"{tiny.url}/health").status_code == 200


@pytest.mark.slow
def test_bench_serve_against_a_running_server(tiny: Server, tmp_path: Path) -> None:
    before = tiny.metrics()["turnout:generation_tokens_total"]
    out = tmp_path / "bench.json"
    args = ["--url", tiny.url, "--api-key", KEY, "--num-prompts", "16", "--input-len", "4:12"]
    args += ["--client-processes", "2"]  # requests dealt over two spawned clients
    args += [
        "--output-len",
        "6",
        "--max-token-id",
        "500",
        "--request-rate",
        "inf",
        "40",
        "--output",
        str(out),
    ]
    cmd = [sys.executable, "-m", "turnout.cli", "bench", "serve", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert (rec["workload"], rec["engine"], rec["model"]) == ("serve", "turnout", "tiny")
    assert {"device", "commit", "date", "config", "command"} <= set(rec)
    assert [x["request_rate"] for x in rec["results"]] == ["inf", 40.0]
    for x in rec["results"]:
        assert (x["completed"], x["failed"], x["short"]) == (16, 0, 0)
        assert 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] and 0 < x["itl_p50_ms"] <= x["itl_p99_ms"]
        assert x["tpot_p50_ms"] > 0 and x["output_throughput"] > 0
        assert x["output_throughput"] == pytest.approx(16 * 6 / x["duration_s"])
        assert x["client_processes"] == 2 and x["client_cpu_s"] > 0
    assert tiny.metrics()["turnout:generation_tokens_total"] - before == 2 * 16 * 6  # the server agrees


def test_disconnect_aborts_and_frees_blocks(tiny: Server, tiny_llama: Path) -> None:
    def running(m: dict) -> bool:
        return m["turnout:num_requests_running"] == 1 and m["turnout:kv_cache_usage_perc"] > 0

    async def go(stream: bool) -> dict:
        async with httpx.AsyncClient(base_url=tiny.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": stream}
            task = asyncio.create_task(http.post("/v1/completions", json=body, timeout=120))
            seen = await asyncio.to_thread(tiny.wait_metrics, running)
            task.cancel()  # closes the connection
            return seen

    for stream in (True, False):
        before = tiny.metrics()["turnout:generation_tokens_total"]
        assert running(asyncio.run(go(stream)))
        m = tiny.wait_metrics(lambda m: m["turnout:num_requests_running"] == 0, timeout=5)
        assert m["turnout:num_requests_running"] == 0 and m["turnout:kv_cache_usage_perc"] == 0
        assert m["turnout:generation_tokens_total"] - before < 500  # aborted, not run to the end


@pytest.mark.slow
def test_full_waiting_queue_answers_503(tmp_path: Path, tiny_llama: Path) -> None:
    server = Server(tmp_path, str(tiny_llama), *TINY, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:
        long = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}

        async def go() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                a = asyncio.create_task(http.post("/v1/completions", json=long))  # runs
                await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:num_requests_running"] == 1)
                b = asyncio.create_task(http.post("/v1/completions", json=long))  # waits
                await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:num_requests_waiting"] == 1)
                c = await http.post("/v1/completions", json=long)  # no room
                a.cancel()
                b.cancel()
                return c

        _check_error(asyncio.run(go()), 503, None, "server_busy")
        server.wait_metrics(
            lambda m: m["turnout:num_requests_running"] + m["turnout:num_requests_waiting"] == 0
        )
        r = server.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_under_load_exits_in_bound(tmp_path: Path, tiny_llama: Path) -> None:
    server = Server(tmp_path, str(tiny_llama), *TINY, "--shutdown-timeout", "0")
    procs = server.descendants()

    async def go() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)

        tasks = [asyncio.create_task(_stream_to_end(client, str(tiny_llama), i, 480)) for i in range(20)]
        await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:num_requests_running"] == 20)
        took = await asyncio.to_thread(server.stop, 30)
        return [took, *await asyncio.gather(*tasks)]

    took, *ends = asyncio.run(go())
    assert took < 20, server.log.read_text()
    assert server.proc.returncode == 0
    assert all("shut down before the request finished" in e for e in ends), ends  # a clear error each
    assert survivors(procs) == []


@pytest.mark.slow
def test_killed_worker_fails_requests_and_health(tmp_path: Path, tiny_llama: Path) -> None:
    pytest.importorskip("turnout_multiproc")
    server = Server(
        tmp_path, str(tiny_llama), *TINY, "--executor", "multiproc", "--tensor-parallel-size", "2"
    )
    try:
        workers = [p for p in server.descendants(server.engine_core()) if _spawned(p)]
        assert len(workers) == 2

        async def go() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)

            tasks = [asyncio.create_task(_stream_to_end(client, str(tiny_llama), i, 480)) for i in range(8)]
            await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:generation_tokens_total"] >= 16)
            os.kill(workers[1], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # never hangs

        ends = asyncio.run(go())
        assert all("worker rank 1 died" in e for e in ends), ends
        m = server.metrics()  # the dead engine runs nothing and holds no KV; every request failed
        assert (m["turnout:num_requests_running"], m["turnout:kv_cache_usage_perc"]) == (0, 0), m
        assert m[f'turnout:request_success_total{{finished_reason="error",model_name="{tiny_llama}"}}'] == 8
        r = httpx.get(f"{server.url}/health", timeout=10)
        _check_error(r, 503, None, "engine_dead")
        _check_error(
            server.post("/v1/completions", {"prompt": [5], "max_tokens": 2}), 503, None, "engine_dead"
        )
        procs = server.descendants()
        assert server.stop(30) < 20 and server.proc.returncode == 0
        assert survivors(procs) == []
    finally:
        server.stop()


@pytest.mark.slow
def test_killed_engine_core_fails_requests_and_health(tmp_path: Path, tiny_llama: Path) -> None:
    server = Server(tmp_path, str(tiny_llama), *TINY)
    try:
        core = server.engine_core()

        async def go() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
            tasks = [asyncio.create_task(_stream_to_end(client, str(tiny_llama), i, 480)) for i in range(8)]
            await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:generation_tokens_total"] >= 16)
            os.kill(core, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # never hangs

        ends = asyncio.run(go())
        assert all("engine core process died (exit code -9)" in e for e in ends), ends
        _check_error(httpx.get(f"{server.url}/health", timeout=10), 503, None, "engine_dead")
        _check_error(
            server.post("/v1/completions", {"prompt": [5], "max_tokens": 2}), 503, None, "engine_dead"
        )
        procs = server.descendants()
        assert server.stop(30) < 20 and server.proc.returncode == 0
        assert survivors([*procs, core]) == []
    finally:
        server.stop()


@pytest.mark.gpu
def test_server_on_cuda_matches_llm_generate(tmp_path: Path, tiny_qwen3: Path) -> None:
    """The engine core steps (and replays CUDA graphs) in its own process: same tokens as LLM.generate."""
    kw = {"dtype": "float32", "gpu_memory_utilization": 0.25}
    prompts = [_prompt(i) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(tiny_qwen3), **kw)
    refs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]  # one at a time, as sent below
    batched = llm.generate(prompts, greedy, use_tqdm=False)
    llm.shutdown()
    server = Server(tmp_path, str(tiny_qwen3), "--dtype", "float32", "--gpu-memory-utilization", "0.25")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        for p, ref in zip(prompts, refs):
            out = client.completions.create(
                model=str(tiny_qwen3), prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.choices[0].text == ref.text and out.usage.completion_tokens == 24

        async def together() -> list[str]:
            aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=str(tiny_qwen3),
                        prompt=p,
                        max_tokens=24,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p in prompts
                )
            )
            return [o.choices[0].text for o in outs]

        # batched as the requests happen to arrive; float32 and the tiny model's wide logit margins make the
        # batch composition irrelevant to the argmax
        assert asyncio.run(together()) == [b.text for b in batched] == [r.text for r in refs]
    finally:
        server.stop()
