"""Faults injected into a real `turnout serve` on 127.0.0.1: a worker of the multiproc executor stopped
(SIGSTOP), and SIGTERM under load. Each answer is checked as a client sees it: SSE events, status codes,
OpenAI's error body, /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from test_server import TINY, Server, _check_error, _spawned, survivors

from tiny_models import make_tiny_model

HEARTBEAT_S = 0.25  # the hung-worker test's heartbeat interval: a rank misses 5 in 1.25 s


async def _stream(http: httpx.AsyncClient, body: dict, events: list[tuple[float, dict]]) -> None:
    """POST a streamed completion; append (arrival time, event) for each SSE data event but [DONE]."""
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append((time.monotonic(), json.loads(line[6:])))


def _error_code(events: list[tuple[float, dict]]) -> str | None:
    return events[-1][1]["error"]["code"] if events and "error" in events[-1][1] else None


def _text(events: list[tuple[float, dict]]) -> str:
    return "".join(e["choices"][0]["text"] for _, e in events if e.get("choices"))


@pytest.mark.slow
def test_hung_worker_fails_requests_health_and_metrics(tmp_path: Path, tiny_llama: Path) -> None:
    pytest.importorskip("turnout_multiproc")
    env = {"TURNOUT_MULTIPROC_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S)}
    args = [str(tiny_llama), *TINY, "--executor", "multiproc", "--tensor-parallel-size", "2"]
    args += ["--served-model-name", "tiny"]
    server = Server(tmp_path, *args, env=env)
    workers = sorted(p for p in server.descendants(server.engine_core()) if _spawned(p))  # rank order
    assert len(workers) == 2
    procs = server.descendants()
    n = 6
    try:

        async def go() -> tuple[float, list[list[tuple[float, dict]]]]:
            events: list[list[tuple[float, dict]]] = [[] for _ in range(n)]
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}
                tasks = [asyncio.create_task(_stream(http, body, ev)) for ev in events]
                await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:num_requests_running"] == n)
                os.kill(workers[1], signal.SIGSTOP)
                stopped = time.monotonic()
                await asyncio.wait_for(asyncio.gather(*tasks), 30)  # never hangs
            return stopped, events

        stopped, events = asyncio.run(go())
        for ev in events:
            assert _error_code(ev) == "engine_dead", ev[-1:]
            assert "worker rank 1 (pid" in ev[-1][1]["error"]["message"], ev[-1]
            assert "hung" in ev[-1][1]["error"]["message"], ev[-1]
            assert ev[-1][0] - stopped < 10, "noticed in seconds, not rpc_timeout"
        r = httpx.get(f"{server.url}/health", timeout=10)
        _check_error(r, 503, None, "engine_dead")
        assert "worker rank 1" in r.json()["error"]["message"]
        new = server.post("/v1/completions", {"prompt": [5], "max_tokens": 2}, key=None)
        _check_error(new, 503, None, "engine_dead")
        m = server.metrics()  # the dead engine runs nothing and holds no KV; every request failed
        assert (m["turnout:num_requests_running"], m["turnout:num_requests_waiting"]) == (0, 0), m
        assert m["turnout:kv_cache_usage_perc"] == 0, m
        assert m['turnout:request_success_total{finished_reason="error",model_name="tiny"}'] == n
        assert "worker rank 1 (pid" in server.log.read_text()  # logged
        assert server.stop(30) < 20 and server.proc.returncode == 0
        assert survivors(procs) == []
    finally:
        for p in workers:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()


@pytest.mark.slow
def test_sigterm_drain_answers_503_and_cuts_streams_as_a_shutdown(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "long", "llama", max_position_embeddings=16384)
    grace = 3.0
    args = [str(model), "--cpu-kv-cache-bytes", str(32 << 20), "--block-size", "16"]
    server = Server(tmp_path, *args, "--shutdown-timeout", str(grace))
    try:

        async def go() -> tuple[float, list, httpx.Response, httpx.Response]:
            long: list[tuple[float, dict]] = []
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"prompt": [5, 6, 7], "max_tokens": 16000, "ignore_eos": True}  # outlasts the grace
                task = asyncio.create_task(_stream(http, body, long))
                await asyncio.to_thread(server.wait_metrics, lambda m: m["turnout:num_requests_running"] == 1)
                server.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.5)
                health = await http.get("/health")
                refused = await http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
                await asyncio.wait_for(task, 30)
            return sent, long, health, refused

        sent, long, health, refused = asyncio.run(go())
        _check_error(refused, 503, None, "server_shutting_down")  # accepted during the drain
        _check_error(health, 503, None, "server_shutting_down")
        assert _error_code(long) == "server_shutting_down", long[-1:]
        assert "shut down before the request finished" in long[-1][1]["error"]["message"]
        assert long[-1][0] - sent >= grace - 0.5  # ran on through the drain, then cut at its deadline
        assert any(t > sent + 0.5 for t, e in long if e.get("choices")), "tokens go on during the drain"
        assert _text(long)
        server.proc.wait(20)
        assert server.proc.returncode == 0, server.log.read_text()
    finally:
        server.stop()
