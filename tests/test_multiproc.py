"""Tensor parallelism over worker processes (gloo on the CPU), data parallelism, and worker faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from turnout import LLM, SamplingParams
from turnout.config import EngineConfig
from turnout.engine import dp
from turnout.errors import ConfigError, TurnoutError
from turnout.executor import ExecutorContext, rank
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.selection import select_all

from procs import alive
from tiny_models import hf_greedy

pytest.importorskip("turnout_multiproc")
from turnout_multiproc import _check  # noqa: E402

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(20, 57)), [300], list(range(400, 419))]
KW = {"cpu_kv_cache_bytes": 1 << 22, "block_size": 8}


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def uniproc_refs(tiny_llama: Path, tiny_qwen3: Path) -> dict[str, list[list[int]]]:
    refs = {}
    for name, path in (("tiny_llama", tiny_llama), ("tiny_qwen3", tiny_qwen3)):
        llm = LLM(str(path), **KW)
        assert llm.selection.executor.chosen.name == "uniproc"
        refs[name] = _tokens(llm)
    return refs


@pytest.fixture(scope="module")
def tp2(tiny_llama: Path, tiny_qwen3: Path):
    """Two TP=2 engines alive at once: Llama shards its 2 KV heads, Qwen3 replicates its 1 KV head."""
    llms = {}
    try:
        for name, path in (("tiny_llama", tiny_llama), ("tiny_qwen3", tiny_qwen3)):
            llms[name] = LLM(str(path), tensor_parallel_size=2, **KW)
        yield llms
    finally:
        for llm in llms.values():
            llm.shutdown()


def test_check_rejects_with_reasons() -> None:
    cpu = Platform("cpu", "cpu", 1, None, 0)
    gpu = Platform("cuda", "H200", 2, (9, 0), 0)
    assert "uniproc" in _check(ExecutorContext(cpu, 1, explicit=False))[0]
    assert _check(ExecutorContext(cpu, 1, explicit=True)) == []
    assert _check(ExecutorContext(cpu, 1, explicit=False, own_processes=True)) == []  # data parallel
    assert _check(ExecutorContext(cpu, 4, explicit=False)) == []
    assert _check(ExecutorContext(gpu, 2, explicit=False)) == []
    reason = "needs 4 GPUs on this node, have 2; use executor=ray for several nodes"
    assert _check(ExecutorContext(gpu, 4, explicit=False)) == [reason]


def test_plan_ranks_shares_out_the_node(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2)
    sel = select_all(cfg, ModelInfo.from_dir(tiny_llama))
    monkeypatch.setattr(rank, "cpu_cores", lambda: 8)
    monkeypatch.setenv("TURNOUT_FUSED_KERNELS", "0")
    infos = rank.plan_ranks(cfg, sel, "tcp://127.0.0.1:1")
    assert [(i.rank, i.local_rank) for i in infos] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert {(i.output_rank, i.threads, i.tp_size, i.world_size) for i in infos} == {(2, 2, 2, 4)}
    pinned = infos[0].config
    assert (pinned.attention_backend, pinned.executor, pinned.model) == ("cpu", "multiproc", str(tiny_llama))
    assert infos[0].env["TURNOUT_FUSED_KERNELS"] == "0" and infos[0].selection is not None
    assert [i.local_rank for i in rank.plan_ranks(cfg, sel, "tcp://h:1", [0] * 4)] == [0] * 4


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_tp2_matches_uniproc(tp2: dict[str, LLM], uniproc_refs: dict, model: str) -> None:
    llm = tp2[model]
    assert llm.selection.executor.chosen.name == "multiproc"
    assert _tokens(llm) == uniproc_refs[model]


def test_tp2_matches_hf(tp2: dict[str, LLM], tiny_qwen3: Path) -> None:
    assert _tokens(tp2["tiny_qwen3"], PROMPTS[:2]) == hf_greedy(tiny_qwen3, PROMPTS[:2], MAX_NEW)


def test_two_engines_side_by_side(tp2: dict[str, LLM], uniproc_refs: dict) -> None:
    engines = {name: llm.engine for name, llm in tp2.items()}
    ports = {e.executor.init_method for e in engines.values()}
    assert len(ports) == 2
    reqs = {name: [e.add_request(p, GREEDY) for p in PROMPTS] for name, e in engines.items()}
    while any(e.has_unfinished() for e in engines.values()):
        for e in engines.values():  # interleaved steps: both process groups stay in use
            e.step()
    for name, e in engines.items():
        e.executor.check_health()
        assert [e.pop_finished(r.req_id)[0].output_token_ids for r in reqs[name]] == uniproc_refs[name]


def test_dp2_matches_dp1(tiny_llama: Path, uniproc_refs: dict) -> None:
    llm = LLM(str(tiny_llama), data_parallel_size=2, **KW)
    front = llm.engine
    assert isinstance(front, dp.DataParallelEngine) and len(front.engines) == 2
    reqs = [front.add_request(p, GREEDY) for p in PROMPTS]
    assert [front.load(e) for e in front.engines] == [2, 2]
    while front.has_unfinished():
        front.step()
    assert [front.pop_finished(r.req_id)[0].output_token_ids for r in reqs] == uniproc_refs["tiny_llama"]
    assert _tokens(llm) == uniproc_refs["tiny_llama"]
    llm.shutdown()


@pytest.mark.slow
def test_dp2_over_worker_processes(tiny_llama: Path, uniproc_refs: dict) -> None:
    llm = LLM(str(tiny_llama), data_parallel_size=2, executor="multiproc", **KW)
    try:
        assert llm.engine._pool is not None  # replicas step in threads
        assert _tokens(llm) == uniproc_refs["tiny_llama"]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_killed_worker_ends_engine(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    ex = llm.engine.executor
    pids, execute, calls = list(ex.pids), ex.execute_model, []

    def execute_then_kill(out) -> None:  # dies while its step is in flight
        execute(out)
        calls.append(1)
        if len(calls) == 3:
            os.kill(pids[1], signal.SIGKILL)

    ex.execute_model = execute_then_kill
    t0 = time.monotonic()
    with pytest.raises(TurnoutError, match=r"worker rank 1 died \(exit code -9\); the engine is shut down"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert time.monotonic() - t0 < 60
    assert _wait_gone(pids, 5) == []
    with pytest.raises(TurnoutError, match="shut down"):
        ex.check_health()
    llm.shutdown()  # idempotent


@pytest.mark.slow
def test_hung_worker_times_out(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    ex = llm.engine.executor
    ex.timeout = 2.0
    os.kill(ex.pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TurnoutError, match=r"rank\(s\) \[0, 1\] did not answer sample_tokens within 2s"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert _wait_gone(ex.pids, 5) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_workers_exit_when_driver_dies(tiny_llama: Path, sig: signal.Signals) -> None:
    """SIGKILL: the workers notice the driver is gone. SIGINT (Ctrl-C) mid-generate: the driver shuts down."""
    script = textwrap.dedent(f"""
        from turnout import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, tensor_parallel_size=2, cpu_kv_cache_bytes=1 << 22)
        print(*llm.engine.executor.pids, flush=True)
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    """)
    start = time.monotonic()
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        # Stopping is a fraction of starting (imports, spawn, load), which this machine just timed under its
        # present load: a bound in those units tells a hang from a busy machine.
        bound = max(30.0, 2 * (time.monotonic() - start))
        time.sleep(0.5)
        driver.send_signal(sig)
        _, err = driver.communicate(timeout=bound)
    finally:
        driver.kill()
        driver.wait()
    if sig == signal.SIGINT:
        assert b"KeyboardInterrupt" in err
    assert _wait_gone(pids, bound / 3) == []


@pytest.mark.slow
def test_worker_error_is_reported(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    with pytest.raises(TurnoutError, match=r"worker rank \d failed in no_such_method: AttributeError"):
        llm.engine.executor.collective_rpc("no_such_method")
    assert _wait_gone(llm.engine.executor.pids, 5) == []


def test_dp_replicas_get_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "current_platform", lambda: Platform("cuda", "H200", 4, (9, 0), 0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cfg = EngineConfig(data_parallel_size=2, tensor_parallel_size=2)
    with dp._visible_devices(1, cfg):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(ConfigError, match="needs 6 GPUs, have 4"):
        with dp._visible_devices(0, cfg.model_copy(update={"data_parallel_size": 3})):
            pass
