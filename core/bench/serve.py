"""`turnout bench serve`: load on an OpenAI-compatible server, in the spirit of vLLM's `bench serve`.

Token-id prompts go to /v1/completions through the `openai` async client at a Poisson request rate (inf: all
at once). Per rate: request and token throughput, TTFT, TPOT ((e2e - TTFT) / (tokens - 1) per request), ITL
(gaps between chunks) and end-to-end latency at mean, p50 and p99, and the failed count; a JSON record goes
to benchmarks/results/serve/. Without --url the command starts `turnout serve` itself (the engine flags are
serve's). --vs-offline then runs the same workload through LLM.generate here as many times as the server
ran it (non-streamed, then streamed) and pairs run k with run k, so that both meet the same prefix-cache
state; both sides count output tokens as nano-vllm does, max_tokens over the wall time (ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from turnout.bench import records, workloads
from turnout.bench.random_models import SHAPES, random_model
from turnout.bench.workloads import Req, random_ids
from turnout.errors import TurnoutError

WORKLOADS = {  # name: (num_prompts, input_len, output_len, temperature)
    "random": (200, (1024, 1024), (128, 128), 0.0),
    "nanovllm": (256, (100, 1024), (100, 1024), 0.6),  # nano-vllm's bench.py, with the default ids and seed
}


def _len_range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not N or MIN:MAX") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"'{s}': need 1 <= MIN <= MAX")
    return a, b


def add_bench_serve_parser(subparsers: Any) -> None:
    from turnout.engine_args import add_engine_args

    p = subparsers.add_parser("serve", help="load an OpenAI-compatible server; TTFT, TPOT, ITL, throughput")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="model folder for the server this starts")
    p.add_argument("--random-model", choices=sorted(SHAPES), help="serve a random-weight checkpoint of it")
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000; default: start one here")
    p.add_argument("--api-key", help="the server's --api-key")
    p.add_argument("--request-model", help="the 'model' to send; default: the server's first model")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="random", help="preset sizes (below)")
    p.add_argument("--num-prompts", type=int, help="requests per run (random: 200, nanovllm: 256)")
    p.add_argument("--input-len", type=_len_range, help="prompt tokens: N or MIN:MAX, uniform")
    p.add_argument("--output-len", type=_len_range, help="max_tokens: N or MIN:MAX, uniform (ignore_eos)")
    p.add_argument("--max-token-id", type=int, default=10000, help="prompt token ids lie in [0, this]")
    p.add_argument("--temperature", type=float, help="random: 0, nanovllm: 0.6")
    p.add_argument("--seed", dest="workload_seed", type=int, default=0, help="seed of the workload's draws")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], help="per s, Poisson; inf")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    cores = max(1, min(8, (os.cpu_count() or 1) // 2))
    p.add_argument("--client-processes", type=int, default=cores,
                   help="processes the requests are dealt over, one openai client each; default: cores / 2, "
                   "at most 8")  # fmt: skip
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="SSE (TTFT, ITL)")
    p.add_argument("--repeat", type=int, default=1, help="runs per rate (each paired with an offline run)")
    p.add_argument("--vs-offline", action="store_true", help="also run LLM.generate here; report the ratio")
    p.add_argument("--output", help="a .json file or a folder (default: benchmarks/results/serve)")
    add_engine_args(p, skip=("seed",))  # --seed is the workload's; the engine seed comes from config or env
    p.set_defaults(fn=run_bench_serve)


def make_requests(args: argparse.Namespace) -> list[Req]:
    """The run's requests: --workload's preset sizes, with the options' overrides."""
    n, inp, out, temp = WORKLOADS[args.workload]
    n, inp, out = args.num_prompts or n, args.input_len or inp, args.output_len or out
    temp = temp if args.temperature is None else args.temperature
    rng = random.Random(args.workload_seed)  # nano-vllm's order: all prompts, then all output lengths
    prompts = [random_ids(rng, rng.randint(*inp), args.max_token_id) for _ in range(n)]
    return [Req(p, rng.randint(*out), temp) for p in prompts]


@dataclass
class Record:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


async def _one(client: Any, model: str, req: Req, stream: bool) -> Record:
    rec, t0 = Record(), time.perf_counter()
    kw = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": req.temperature}
    kw["extra_body"] = {"ignore_eos": req.ignore_eos}
    try:
        if stream:
            last, usage = t0, {"include_usage": True}
            async for chunk in await client.completions.create(**kw, stream=True, stream_options=usage):
                now = time.perf_counter()
                if chunk.choices:
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                if chunk.usage is not None:
                    rec.output_tokens = chunk.usage.completion_tokens
        else:
            rec.output_tokens = (await client.completions.create(**kw)).usage.completion_tokens
        rec.e2e, rec.ok = time.perf_counter() - t0, True
    except Exception as e:  # noqa: BLE001 - a failed request is a result, counted
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def _client(
    url: str, key: str, model: str, reqs: list[Req], start: float, stream: bool, part: list, concurrency: int
) -> tuple[list[tuple[int, Record]], float, float]:
    """One client process's share of a run, request i sent at `start` + its offset (wall clock): its records,
    the wall-clock time the last ended, and this process's CPU seconds."""
    import openai

    async def send_all() -> tuple[list[tuple[int, Record]], float]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=3600)
        gate = asyncio.Semaphore(concurrency)

        async def send(i: int, at: float) -> tuple[int, Record]:
            await asyncio.sleep(max(0.0, start + at - time.time()))
            async with gate:
                return i, await _one(client, model, reqs[i], stream)

        records = await asyncio.gather(*(send(i, at) for i, at in part))
        end = time.time()
        await client.close()
        return records, end

    cpu0 = time.process_time()
    return *asyncio.run(send_all()), time.process_time() - cpu0


def _warm_client(_: int) -> None:
    import openai  # noqa: F401 - a spawned client pays its imports before the clock starts

    time.sleep(0.5)  # held, so that each warm-up lands on a process of its own


def _run(url: str, api_key: str | None, model: str | None, reqs: list[Req], rate: float, args: Any) -> dict:
    """One run at `rate`: the requests dealt round-robin over --client-processes processes, each an
    asyncio loop with its own openai.AsyncOpenAI, on one shared Poisson arrival schedule."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    model = model or _first_model(url, api_key)
    rng, at, offsets = random.Random(args.workload_seed + 1), 0.0, []  # arrival gaps
    for _ in reqs:
        offsets.append(at)
        at += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    parts, gates = deal(offsets, args.client_processes, args.max_concurrency)
    k, server_cpu0 = len(parts), _tree_cpu_s(args.server_pid)
    with ProcessPoolExecutor(k, mp_context=get_context("spawn")) as pool:
        list(pool.map(_warm_client, range(k)))
        start = time.time()
        client = partial(_client, url, api_key or "none", model, reqs, start, args.stream)
        outs = list(pool.map(client, parts, gates))
    records = [r for _, r in sorted(x for recs, _, _ in outs for x in recs)]  # every request was dealt once
    res = _summary(records, reqs, max(end for _, end, _ in outs) - start, rate, model)
    res |= {"client_processes": k, "client_cpu_s": sum(cpu for _, _, cpu in outs)}
    if args.server_pid:
        after = _tree_cpu_s(args.server_pid)
        res["server_cpu_s"] = {name: s - server_cpu0.get(name, 0.0) for name, s in after.items()}
    return res


def deal(
    offsets: list[float], processes: int, max_concurrency: int | None
) -> tuple[list[list[tuple[int, float]]], list[int]]:
    """Requests (index, arrival offset) dealt round-robin over at most `processes` clients, and each
    client's share of max_concurrency (all requests where None): the shares add up to it exactly."""
    limit = max_concurrency or len(offsets)
    k = max(1, min(processes, len(offsets), limit))
    parts = [[(i, offsets[i]) for i in range(j, len(offsets), k)] for j in range(k)]
    return parts, [limit // k + (j < limit % k) for j in range(k)]


def _first_model(url: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key or 'none'}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def _tree_cpu_s(pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of a process and each of its descendants, by "name pid", from /proc;
    empty where /proc is not there."""
    out: dict[str, float] = {}
    todo = [pid] if pid else []
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        out["api server" if p == pid else f"{name} {p}"] = ticks / os.sysconf("SC_CLK_TCK")
        todo += map(int, kids)
    return out


def _summary(records: list[Record], reqs: list[Req], duration: float, rate: float, model: str) -> dict:
    import numpy as np

    done = [(q, r) for q, r in zip(reqs, records) if r.ok]
    ok = [r for _, r in done]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in records if r.error})
    res: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "model": model,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        # completed with fewer tokens than max_tokens despite ignore_eos: a server bug
        "short": sum(r.output_tokens != q.max_tokens for q, r in done),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (sum(len(q.prompt) for q, _ in done) + out_tokens) / duration,
        "max_tokens_throughput": sum(q.max_tokens for q, _ in done) / duration,
    }
    streamed = [r for r in ok if r.ttft is not None]
    times = {
        "ttft": [r.ttft for r in streamed],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in streamed if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    for name, values in times.items():  # ms at mean, p50 and p99
        ms = np.asarray(values) * 1e3
        got = [ms.mean(), *np.percentile(ms, [50, 99])] if values else [None] * 3
        res |= {
            f"{name}_{s}_ms": None if v is None else float(v) for s, v in zip(("mean", "p50", "p99"), got)
        }
    if errors:
        res["errors"] = errors[:5]
    return res


def _print(res: dict) -> None:
    print(f"---- request rate {res['request_rate']} ({res.get('mode', '')}) ----")
    for k, v in res.items():
        if k not in ("request_rate", "errors", "mode"):
            print(f"  {k:24s} {v:.2f}" if isinstance(v, float) else f"  {k:24s} {v}")
    for e in res.get("errors", []):
        print(f"  error: {e}")


# ---- a server of our own ----
def _engine_argv(args: argparse.Namespace) -> list[str]:
    from turnout.config import EngineConfig

    argv = ["--config", args.config] if args.config else []
    for name in EngineConfig.model_fields:
        value, flag = getattr(args, name, None), "--" + name.replace("_", "-")
        if value is None or name == "seed":
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def _start_server(args: argparse.Namespace, num_prompts: int) -> tuple[subprocess.Popen, str]:
    from turnout.executor.rank import free_port  # imports torch: not at `turnout --help`

    port = free_port()
    cmd = [sys.executable, "-m", "turnout.cli", "serve", *_engine_argv(args), "--port", str(port)]
    cmd += ["--max-waiting-requests", str(max(1024, num_prompts))]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise TurnoutError(f"the server exited with status {proc.returncode} before it answered /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)


def _stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _offline(args: argparse.Namespace, reqs: list[Req], runs: int) -> list[float]:
    """Output tok/s of LLM.generate on the workload, per run, after the bench's warm-up."""
    from turnout import LLM
    from turnout.engine_args import engine_config_from_args

    llm = LLM(config=engine_config_from_args(args))
    try:
        workloads.warm_up(llm)
        rates = [sum(r.max_tokens for r in reqs) / workloads.run(llm, reqs)[0] for _ in range(runs)]
        print("offline LLM.generate: " + ", ".join(f"{r:.0f}" for r in rates) + " tok/s")
        return rates
    finally:
        llm.shutdown()


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.vs_offline and args.url:
        raise TurnoutError("--vs-offline compares with a server this command starts; leave out --url")
    if min(args.repeat, args.client_processes, args.max_concurrency or 1) < 1:
        raise TurnoutError("--repeat, --client-processes and --max-concurrency must be >= 1")
    if args.model_tag and args.model and args.model_tag != args.model:
        raise TurnoutError(f"two models given ({args.model_tag} and --model {args.model}); pass one")
    args.model, args.model_tag = args.model_tag or args.model, None  # one place: the engine flags
    if args.random_model:
        if args.model:
            raise TurnoutError(f"two models given ({args.model} and --random-model); pass one")
        args.model = str(random_model(args.random_model))
    reqs = make_requests(args)
    proc, url = (None, args.url.rstrip("/")) if args.url else _start_server(args, len(reqs))
    args.server_pid = proc.pid if proc is not None else None
    runs = []
    try:
        modes = [False, True] if args.vs_offline else [args.stream]
        for stream, rate, _ in itertools.product(modes, args.request_rate, range(args.repeat)):
            args.stream = stream
            res = _run(url, args.api_key, args.request_model, reqs, rate, args)
            res["mode"] = "stream" if stream else "no-stream"
            _print(res)
            runs.append(res)
    finally:
        if proc is not None:
            _stop_server(proc)
    record = {"workload": "serve", "engine": "turnout", "model": args.model or runs[0]["model"]}
    record |= records.provenance()
    record["config"] = {k: _jsonable(v) for k, v in vars(args).items() if v is not None and k not in SECRET}
    record["results"] = runs
    if args.vs_offline:  # run k of the server against run k offline: both see the same prefix-cache history
        offline = _offline(args, reqs, len(runs))
        for r, off in zip(runs, offline):
            r["offline_output_throughput"], r["vs_offline"] = off, r["max_tokens_throughput"] / off
        for mode in ("no-stream", "stream"):
            pairs = [r for r in runs if r["mode"] == mode]
            ratio = record[f"ratio_{mode}"] = sum(r["vs_offline"] for r in pairs) / len(pairs)
            print(f"server ({mode}) / offline, mean of {len(pairs)} paired runs: {ratio:.3f}")
        record["offline_tok_s"] = offline
    tag = "serve-" + args.workload + ("-vs-offline" if args.vs_offline else "")
    path = records.write(record, args.output or "benchmarks/results/serve", tag, record["device"])
    print(f"wrote {path}")
    return 1 if any(r["failed"] or r["short"] for r in runs) else 0


SECRET = ("fn", "api_key", "server_pid")


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return [_jsonable(x) for x in v] if isinstance(v, list | tuple) else v
