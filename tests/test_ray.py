"""The Ray executor on one local CPU cluster (gloo): parity with uniproc, the auto rule, and faults; and on a
simulated two-node cluster, where one placement group spans both nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.config import EngineConfig
from turnout.errors import TurnoutError
from turnout.executor import ExecutorContext
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.selection import select_all

from procs import alive

ray = pytest.importorskip("ray")
turnout_ray = pytest.importorskip("turnout_ray")
from turnout_ray import executor as ray_executor  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(20, 57)), [300], list(range(400, 419))]
KW = {"cpu_kv_cache_bytes": 1 << 22, "block_size": 8}
CPU = Platform("cpu", "cpu", 1, None, 0)
GPU1 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.float16, torch.float32, torch.bfloat16))


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _eventually(ok: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.1)
    return ok()


def _all_freed() -> bool:
    """No actor and no placement group of ours holds a CPU of the cluster."""
    return ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """One local cluster for the module, opened the executor's way (2 CPUs: one engine of TP=2 at a time);
    each engine joins it as one more user and leaves it running."""
    if ray.is_initialized():
        pytest.skip("this process is already attached to a Ray cluster")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        assert ray_executor._connect(2, cuda=False)
        yield
        ray_executor._release(ray_executor._Held(joined=True))
    assert not ray.is_initialized()  # the last user left: the local cluster is gone


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), **KW)
    assert llm.selection.executor.chosen.name == "uniproc"
    return _tokens(llm)


def test_check_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    check = turnout_ray._check
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert check(ExecutorContext(CPU, 2, explicit=True)) == []
    assert check(ExecutorContext(GPU1, 2, explicit=False)) == []  # more ranks than GPUs here: several nodes
    assert "fits on this node; multiproc serves it" in check(ExecutorContext(CPU, 2, explicit=False))[0]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert check(ExecutorContext(CPU, 2, explicit=False)) == []
    assert "uniproc runs it" in check(ExecutorContext(CPU, 1, explicit=False))[0]
    monkeypatch.setattr(turnout_ray.importlib.util, "find_spec", lambda name: None)
    assert check(ExecutorContext(CPU, 2, explicit=True)) == ["ray is not installed (pip install turnout-ray)"]


def test_auto_picks_ray_only_when_needed(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = ModelInfo.from_dir(tiny_llama)

    def chosen(platform: Platform | None, tp: int) -> str:
        sel = select_all(
            EngineConfig(model=str(tiny_llama), tensor_parallel_size=tp), info, platform=platform
        )
        return sel.executor.chosen.name

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert chosen(GPU1, 2) == "ray"  # 2 ranks, 1 GPU on this node
    assert chosen(None, 2) == "multiproc"  # this CPU machine
    assert chosen(None, 1) == "uniproc"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert chosen(None, 2) == "ray"
    assert chosen(None, 1) == "uniproc"
    assert ray_executor.init_args(2, cuda=False)["address"] == "10.0.0.1:6379"


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
@pytest.mark.slow
def test_matches_uniproc(
    cluster: None, tiny_llama: Path, reference: list[list[int]], tp: int, pp: int
) -> None:
    llm = LLM(str(tiny_llama), executor="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, **KW)
    ex = llm.engine.executor
    try:
        assert llm.selection.executor.chosen.name == "ray" and not llm.selection.executor_spec.in_process
        assert _tokens(llm) == reference
        assert len(set(ex.pids)) == 2 and all(map(alive, ex.pids))
        assert len(set(ex.collective_rpc("kv_bytes_per_block"))) == 1
        ex.check_health()
    finally:
        llm.shutdown()
    llm.shutdown()  # idempotent
    assert ray.is_initialized()  # the module's cluster, not the engine's to stop
    assert _eventually(lambda: _all_freed() and not any(map(alive, ex.pids)))
    with pytest.raises(TurnoutError, match="executor ray is shut down"):
        ex.check_health()


# A driver process that starts a two-node cluster on this machine (ray.cluster_utils.Cluster: a head node and
# a second node, 1 CPU each, so one CPU bundle per rank fits on neither node alone), attaches to it through
# RAY_ADDRESS as a user would, runs TP=2 and PP=2 and reports, per run, the tokens and the Ray node each rank
# ran on. It prints every process it started (cluster daemons, workers, actors) before it shuts the cluster
# down, so the test can check that none is left.
TWO_NODES = """
import json, os, sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from turnout import LLM, SamplingParams

def descendants(root):
    kids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [root]
    while todo:
        out.update(new := kids.get(todo.pop(), []))
        todo += new
    return out

model, prompts, kw = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
started, report = set(), {"runs": {}}
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
try:
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    report["nodes"] = [node.node_id for node in cluster.list_all_nodes()]
    os.environ["RAY_ADDRESS"] = cluster.address
    for tp, pp in ((2, 1), (1, 2)):
        sizes = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        llm = LLM(model, executor="ray", rpc_timeout=30, **sizes, **kw)  # unplaceable bundles: 30 s
        try:
            ex = llm.engine.executor
            tokens = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            node_id = lambda actor: ray.get_runtime_context().get_node_id()
            table = ray.util.placement_group_table(ex._held.pg)
            report["runs"][f"tp{tp}pp{pp}"] = {
                "executor": llm.selection.executor.chosen.name,
                "tokens": tokens,
                "rank_nodes": ray.get([a.__ray_call__.remote(node_id) for a in ex.actors]),
                "bundle_nodes": sorted(table["bundles_to_node_id"].values()),
                "strategy": table["strategy"],
                "rank_pids": ex.pids,
            }
            started |= descendants(os.getpid())
        finally:
            llm.shutdown()
        report["runs"][f"tp{tp}pp{pp}"]["left_ray"] = not ray.is_initialized()
    started |= descendants(os.getpid())
    print("STARTED", json.dumps(sorted(started)), flush=True)
finally:
    cluster.shutdown()
print("REPORT", json.dumps(report), flush=True)
"""


@pytest.mark.slow
def test_placement_group_spans_two_nodes(tiny_llama: Path, reference: list[list[int]]) -> None:
    """Issue #6: one CPU bundle per rank, placed PACK on a two-node cluster, lands one rank on each node;
    TP=2 and PP=2 across the nodes give uniproc's greedy tokens; the cluster leaves no process behind."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-c", TWO_NODES, str(tiny_llama), json.dumps(PROMPTS), json.dumps(KW)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    tagged = [line.split(" ", 1) for line in stdout.splitlines() if line.startswith(("STARTED ", "REPORT "))]
    lines = dict(tagged)
    started = json.loads(lines.get("STARTED", "[]"))
    try:
        assert proc.returncode == 0 and "REPORT" in lines, stderr[-3000:]
        report = json.loads(lines["REPORT"])
        nodes = report["nodes"]
        assert len(set(nodes)) == 2
        assert set(report["runs"]) == {"tp2pp1", "tp1pp2"}
        for run in report["runs"].values():
            assert run["executor"] == "ray" and run["strategy"] == "PACK"
            assert run["tokens"] == reference
            assert sorted(run["rank_nodes"]) == sorted(nodes)  # rank 0 on one node, rank 1 on the other
            assert run["bundle_nodes"] == sorted(nodes)
            assert run["left_ray"]  # the driver disconnected once its engine was gone
            assert set(run["rank_pids"]) <= set(started)
        assert _eventually(lambda: not any(map(alive, started)))
    finally:
        for pid in filter(alive, started):  # only on failure: what this test started and left behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_killed_actor_ends_engine(cluster: None, tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), executor="ray", tensor_parallel_size=2, **KW)
    ex = llm.engine.executor
    pids, victim, execute, calls = list(ex.pids), ex.actors[1], ex.execute_model, []

    def execute_then_kill(out) -> None:  # rank 1 dies while its step is in flight
        execute(out)
        calls.append(1)
        if len(calls) == 3:
            ray.kill(victim)

    ex.execute_model = execute_then_kill
    t0 = time.monotonic()
    with pytest.raises(
        TurnoutError, match=r"worker rank 1 \(node .*, pid \d+\) died: .*; the engine is shut"
    ):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert _eventually(lambda: _all_freed() and not any(map(alive, pids)))
    with pytest.raises(TurnoutError, match="shut down"):
        ex.check_health()
    llm.shutdown()


@pytest.mark.slow
def test_worker_error_is_reported(cluster: None, tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), executor="ray", tensor_parallel_size=2, **KW)
    pids = llm.engine.executor.pids
    with pytest.raises(TurnoutError, match=r"worker rank \d failed in no_such_method: AttributeError"):
        llm.engine.executor.collective_rpc("no_such_method")
    assert _eventually(lambda: _all_freed() and not any(map(alive, pids)))


@pytest.mark.slow
def test_driver_attaches_through_ray_address(cluster: None, tiny_llama: Path, reference: list) -> None:
    """A second driver process joins this cluster the way a `ray start --head` cluster is joined, chooses
    ray by the auto rule, and leaves the cluster running."""
    script = textwrap.dedent(f"""
        from turnout import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, tensor_parallel_size=2, **{KW!r})
        out = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        print(llm.selection.executor.chosen.name, [o.token_ids for o in out])
        llm.shutdown()
    """)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == f"ray {reference}"
    assert _eventually(_all_freed)
