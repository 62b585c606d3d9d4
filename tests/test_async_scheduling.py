"""Async scheduling (step N+1 scheduled before step N's tokens reach the host) against the sync engine as the
reference: the same tokens, finish and stop reasons, text and logprobs with their ranks, request by request,
under EOS and stop tokens, stop strings, max_tokens, chunked prefill, preemption,
prefix-cache hits, seeded sampling, penalties, min_tokens, bad words, logit_bias, prompt logprobs and aborts.
On the CPU nothing overlaps, but every step of the logic is the same."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.config import EngineConfig
from turnout.engine.block_manager import BlockManager
from turnout.engine.request import Request
from turnout.engine.scheduler import Scheduler, placeholder
from turnout.errors import ConfigError

# Chunked prefill (16-token budget over 4-token blocks) and preemption (26 blocks for 6 requests of up to
# 99 tokens); max_model_len is the cache's 104 tokens, which every request fits, since one that does not is
# refused before it runs.
SMALL = dict(
    attention_backend="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
    num_gpu_blocks_override=26, max_model_len=104,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny models' matmuls are too small to share: a second torch thread only waits on the first."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompts(n: int = 18) -> list[list[int]]:
    """Half share a 17-token prefix (prefix-cache hits once its blocks are computed), half are unrelated."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(17)]
    return [
        (prefix if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(2, 22))]
        for i in range(n)
    ]


def _logprobs(rows) -> list[list[tuple[int, int | None, float]]] | None:
    """(token, rank, logprob) of every entry, position by position; None where none were asked."""
    return (
        None
        if rows is None
        else [sorted((t, lp.rank, lp.logprob) for t, lp in (d or {}).items()) for d in rows]
    )


def _run(path, prompts, params, **cfg) -> tuple[list[tuple], dict]:
    llm = LLM(str(path), **{**SMALL, **cfg})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        res = [
            (
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                c.text,
                _logprobs(c.logprobs),
                _logprobs(o.prompt_logprobs),
            )
            for o in outs
            for c in o.outputs
        ]
        return res, stats
    finally:
        llm.shutdown()


def _assert_same(got: list[tuple], ref: list[tuple], params) -> None:
    """Tokens, finish and stop reasons, text exactly; logprobs' tokens and ranks exactly, values to 1e-4."""
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert g[:4] == r[:4], f"request {i} ({params[i]})"
        for want, have in zip(r[4:], g[4:]):
            if want is None:
                assert have is None, i
                continue
            assert [[(t, k) for t, k, _ in row] for row in have] == [
                [(t, k) for t, k, _ in row] for row in want
            ], i
            flat = lambda rows: [lp for row in rows for _, _, lp in row]
            assert flat(have) == pytest.approx(flat(want), abs=1e-4), i


def _mixed_params(free: list[list[int]], tok) -> list[SamplingParams]:
    """One stop mechanism per request, each set to fire inside the request's greedy free run `free[i]`."""
    params = []
    for i, run in enumerate(free):
        kind, k = i % 6, 2 + i % 5
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=[1, 2, 7, 13][i % 4], ignore_eos=True)
        elif kind == 1:  # EOS: generation_config.json names these runs' tokens as EOS ids
            sp = SamplingParams(temperature=0, max_tokens=40)
        elif kind == 2:
            sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[run[k]])
        elif kind == 3:
            sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[tok.decode(run[k])])
        elif kind == 4:
            sp = SamplingParams(
                temperature=0.9, top_p=0.95, seed=i, max_tokens=15, ignore_eos=True, logprobs=2
            )
        else:  # the longest: prompt + 60 tokens, up to 99 of the cache's 104
            sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=0)
        params.append(sp)
    return params


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3"])
def eos_model(request, tmp_path_factory):
    """A tiny model whose EOS ids are tokens that its greedy runs on _prompts() produce, so requests stop
    on EOS mid-run. Returns (path, free runs, tokenizer)."""
    src = request.getfixturevalue(request.param)
    path = tmp_path_factory.mktemp(f"{request.param}_eos")
    shutil.copytree(src, path, dirs_exist_ok=True)
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(path), attention_backend="cpu", max_model_len=104)
    free = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    tok = llm.tokenizer
    llm.shutdown()
    eos = sorted({run[3 + i % 4] for i, run in enumerate(free) if i % 6 == 1})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *eos]}))
    return path, free, tok


def test_async_equals_sync_token_for_token(eos_model):
    path, free, tok = eos_model
    prompts, params = _prompts(), _mixed_params(free, tok)
    ref, ref_stats = _run(path, prompts, params, async_scheduling=False)
    got, stats = _run(path, prompts, params, async_scheduling=True)
    _assert_same(got, ref, params)
    reasons = {(i % 6, r[1]) for i, r in enumerate(ref)}
    assert {(1, "stop"), (2, "stop"), (3, "stop"), (0, "length"), (5, "length")} <= reasons
    for s in (ref_stats, stats):  # the workload did preempt and hit the prefix cache, and leaked no block
        assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0
        assert s["free_blocks"] == s["total_blocks"]


def test_seeded_sampling_is_the_same_with_and_without(tiny_llama):
    prompts = _prompts(8)
    sp = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=12, ignore_eos=True, n=2)
    ref, _ = _run(tiny_llama, prompts, sp, async_scheduling=False)
    got, _ = _run(tiny_llama, prompts, sp, async_scheduling=True)
    assert [g[0] for g in got] == [r[0] for r in ref]
    assert ref[0][0] != ref[1][0]  # seed and seed + 1 differ: the rows do sample


def test_penalties_read_the_previous_step(tiny_llama):
    """Penalties need each step's tokens in the next step's inputs; such steps run in series. (Several of
    these prompts' greedy runs repeat their last token at once, which the penalties forbid.)"""
    prompts = _prompts()
    sp = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ] * 6
    ref, _ = _run(tiny_llama, prompts, sp, async_scheduling=False)
    got, _ = _run(tiny_llama, prompts, sp, async_scheduling=True)
    assert [g[0] for g in got] == [r[0] for r in ref]


@pytest.fixture(scope="module")
def free_runs(tiny_llama) -> tuple[list[list[int]], list[list[int]]]:
    """_prompts(12) and their greedy runs of 20 tokens."""
    prompts = _prompts(12)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return prompts, [r[0] for r in _run(tiny_llama, prompts, sp, async_scheduling=False)[0]]


def _async_equals_sync(path, prompts, params) -> list[tuple]:
    ref, _ = _run(path, prompts, params, async_scheduling=False)
    got, _ = _run(path, prompts, params, async_scheduling=True)
    _assert_same(got, ref, params)
    return ref


def test_min_tokens_counts_the_token_in_flight(tiny_llama, free_runs):
    """min_tokens needs only how many tokens are out, the one in flight included: a stop token first met
    exactly at min_tokens ends the request there; one met earlier is masked."""
    prompts, free = free_runs
    params, ends = [], []
    for i, run in enumerate(free):
        if i % 2:
            params.append(SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[run[1]]))
            continue
        j = next(j for j in range(3, len(run)) if run[j] not in run[:j])
        ends.append((i, j))
        params.append(SamplingParams(temperature=0, max_tokens=20, min_tokens=j, stop_token_ids=[run[j]]))
    ref = _async_equals_sync(tiny_llama, prompts, params)
    for i, j in ends:
        assert ref[i][0] == free[i][: j + 1] and ref[i][1:3] == ("stop", free[i][j]), i
    assert all(len(ref[i][0]) >= 6 for i in range(1, len(free), 2))


def test_bad_words_read_the_previous_step(tiny_llama, free_runs):
    """A two-token bad word needs the token before it, so a step that samples for the request is read before
    the next is scheduled; the reference never produces the pair its greedy run had."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    prompts, free = free_runs
    params, pairs = [], []
    for i, run in enumerate(free):
        k = next(k for k in range(2 + i % 4, len(run) - 1) if min(run[k : k + 2]) >= 3)  # no special token
        word = tok.decode(run[k : k + 2])
        assert tok.encode(word, add_special_tokens=False) == run[k : k + 2]
        pairs.append(run[k : k + 2])
        params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word]))
    ref = _async_equals_sync(tiny_llama, prompts, params)
    for (out, *_), pair in zip(ref, pairs):
        assert all(out[t : t + 2] != pair for t in range(len(out) - 1))


def test_logit_bias_and_logprobs_with_ranks(tiny_llama, free_runs):
    prompts, free = free_runs
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=20, ignore_eos=True, logit_bias={run[1]: -100.0, run[2]: 2.0},
            logprobs=3 if i % 2 else 0, prompt_logprobs=2 if i % 3 == 0 else None,
        )
        for i, run in enumerate(free)
    ]  # fmt: skip
    ref = _async_equals_sync(tiny_llama, prompts, params)
    for i, (out, _, _, _, lps, prompt_lps) in enumerate(ref):
        assert free[i][1] not in out
        assert len(lps) == len(out)
        for t, row in zip(out, lps):
            ranks = {tk: k for tk, k, _ in row}
            assert t in ranks and ranks[t] >= 1 and len(row) >= params[i].logprobs
        assert (prompt_lps is not None and len(prompt_lps) == len(prompts[i])) == (i % 3 == 0)


def test_prefix_cache_holds_generated_tokens(tiny_llama):
    """A next turn, prompt + output + more, finds every full block of the finished history in the cache:
    blocks are hashed once their tokens are known, though a launched step may already compute them."""
    prompt = _prompts(1)[0][:10]
    sp = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    cached = {}
    for on in (False, True):
        llm = LLM(str(tiny_llama), **SMALL, async_scheduling=on)
        first = llm.generate([prompt], sp, use_tqdm=False)[0]
        cached[on] = llm.generate([prompt + first.token_ids + [7]], sp, use_tqdm=False)[0].num_cached_tokens
        llm.shutdown()
    assert cached == {False: 24, True: 24}  # 25 tokens of history, the last never computed: 6 blocks of 4


def test_stream_is_the_same(tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts = []
    for on in (False, True):
        llm = LLM(str(tiny_llama), **SMALL, async_scheduling=on)
        texts.append(list(llm.stream(_prompts(1)[0], sp)))
        llm.shutdown()
    assert texts[0] == texts[1] and len(texts[0]) > 1


def test_abort_in_flight_and_reused_id(tiny_llama):
    """An aborted request gets no token from the step in flight; an id popped and added again while that
    step runs is a new request, untouched by the old one's token; no block leaks."""
    llm = LLM(str(tiny_llama), **SMALL, async_scheduling=True)
    ref = LLM(str(tiny_llama), **SMALL, async_scheduling=False)
    try:
        prompts = _prompts(4)
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        want = [o.token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
        engine = llm.engine
        reqs = [engine.add_request(p, sp, req_id=f"r{i}") for i, p in enumerate(prompts)]
        while len(reqs[0].output_token_ids) < 3:
            engine.step()
        assert engine._in_flight is not None and "r0" in engine._in_flight.requests
        engine.abort("r0")
        old, _ = engine.pop_finished("r0")
        again = engine.add_request(prompts[0], sp, req_id="r0")
        while engine.has_unfinished():
            engine.step()
        assert old.output_token_ids == want[0][: len(old.output_token_ids)] and old.finish_reason == "abort"
        assert [r.output_token_ids for r in [again, *reqs[1:]]] == want
        stats = engine.stats()
        assert stats["free_blocks"] == stats["total_blocks"]
    finally:
        llm.shutdown()
        ref.shutdown()


def _req(i: int, prompt: list[int], **sp) -> Request:
    return Request(str(i), prompt, SamplingParams(temperature=0, **sp))


def test_scheduler_runs_in_flight_tokens_as_placeholders_and_drops_late_ones():
    s = Scheduler(BlockManager(num_blocks=32, block_size=4), 8, 64, max_model_len=64)
    a, b = _req(0, [5, 6, 7], max_tokens=9), _req(1, [8, 9], max_tokens=1)
    c = _req(2, [3, 4], max_tokens=9, stop_token_ids=[42])
    reqs = {r.req_id: r for r in (a, b, c)}
    for r in (a, b, c):
        s.add(r)
    n0 = s.schedule()
    n1 = s.schedule()  # before n0's tokens are known: b's in-flight token is its last (max_tokens=1)
    assert [(r.req_id, r.token_ids, r.start_pos, r.sample) for r in n1.requests] == [
        ("0", [placeholder(0)], 3, True),
        ("2", [placeholder(2)], 2, True),  # the rows of n0's sampled tokens
    ]
    s.update(n0, {"0": 11, "1": 12, "2": 42}, reqs)  # c stops on its n0 token while in n1 already
    assert b.finish_reason == "length" and c.finish_reason == "stop" and c.block_ids == ([],)
    assert s.update(n1, {"0": 13, "2": 99}, reqs) == [a]  # c's n1 token is dropped
    assert a.output_token_ids == [11, 13] and c.output_token_ids == [42] and a.num_output_placeholders == 0
    n2 = s.schedule()
    assert [(r.req_id, r.token_ids, r.start_pos) for r in n2.requests] == [("0", [13], 4)]
    assert n2.finished_req_ids == ["1", "2"]


def test_async_scheduling_on_with_cuda_off_on_cpu_by_default_and_refused_where_unsupported(tiny_llama):
    from turnout.models.info import ModelInfo
    from turnout.platform import Platform
    from turnout.selection import resolve_async_scheduling, select_all

    info = ModelInfo.from_dir(str(tiny_llama))
    auto = select_all(EngineConfig(), info)
    assert auto.async_scheduling is False and "host thread" in auto.async_scheduling_note
    h200 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.bfloat16, torch.float32))
    assert resolve_async_scheduling(None, auto.executor_spec, h200) == (
        True,
        "on: executor uniproc supports it, with CUDA (--no-async-scheduling)",
    )
    assert resolve_async_scheduling(False, auto.executor_spec, h200)[0] is False
    assert select_all(EngineConfig(async_scheduling=True), info).async_scheduling is True
    with pytest.raises(ConfigError, match="executor multiproc does not support it"):
        select_all(EngineConfig(async_scheduling=True, executor="multiproc"), info)
    off = select_all(EngineConfig(executor="multiproc"), info)
    assert off.async_scheduling is False and "multiproc" in off.async_scheduling_note


def test_explain_shows_async_scheduling_and_why(tiny_llama, capsys):
    from turnout.cli import main

    settings = {}
    for flags in ([], ["--async-scheduling"], ["--no-async-scheduling"]):
        assert main(["explain", "--model", str(tiny_llama), "--json", *flags]) == 0
        settings[tuple(flags)] = json.loads(capsys.readouterr().out)["settings"]["async_scheduling"]
    assert settings[()] == {
        "value": False,
        "source": "fitted: off: on cpu the forward runs in the host thread",
    }
    assert settings[("--async-scheduling",)] == {"value": True, "source": "flag"}
    assert settings[("--no-async-scheduling",)] == {"value": False, "source": "flag"}
    assert main(["explain", "--model", str(tiny_llama)]) == 0
    assert "fitted: off: on cpu" in capsys.readouterr().out.split("engine settings", 1)[1]


def test_env_switch(monkeypatch):
    monkeypatch.setenv("TURNOUT_ASYNC_SCHEDULING", "1")
    assert EngineConfig.load().async_scheduling is True
    monkeypatch.setenv("TURNOUT_ASYNC_SCHEDULING", "0")
    assert EngineConfig.load().async_scheduling is False


@pytest.mark.slow
def test_embedded_model_chat_with_eos_and_stop_strings():
    chats = ["What is the capital of France?", "Say hello.", "What is 2+2?", "Count from 1 to 20."]
    chats.append("Name three colours.")
    greedy = SamplingParams(temperature=0, max_tokens=40)
    sps = [greedy] * 3 + [SamplingParams(temperature=0, max_tokens=40, stop=["5"]), greedy]
    outs = {}
    for on in (False, True):
        llm = LLM(max_model_len=256, dtype="float32", async_scheduling=on, max_num_batched_tokens=64)
        texts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
        outs[on] = [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(texts, sps, use_tqdm=False)]
        llm.shutdown()
    assert outs[True] == outs[False]
    assert [r for _, r, _ in outs[False]] == ["stop"] * 4 + ["length"]  # EOS three times, a stop string
    assert "4" in outs[False][3][2] and "5" not in outs[False][3][2]


# ---- CUDA ----
@pytest.mark.gpu
def test_cuda_async_equals_sync_and_a_decode_step_never_syncs(tiny_llama):
    """On the device, with graphs: async scheduling on gives the same tokens as sync; and a steady
    decode step (schedule and launch step N+1, read step N) makes no stream or device sync: waiting on the
    sampled tokens' event is its only wait."""
    prompts = _prompts(32)
    sp = [SamplingParams(temperature=0.7, seed=i, max_tokens=24, ignore_eos=True) for i in range(16)] + [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[7, 11]) for _ in range(16)
    ]
    cfg = dict(dtype="float32", gpu_memory_utilization=0.2, max_num_batched_tokens=128)
    outs = {}
    for on in (False, True):
        llm = LLM(str(tiny_llama), async_scheduling=on, **cfg)
        assert llm.engine.async_scheduling is on
        outs[on] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if on:
            engine = llm.engine
            for p in prompts:
                engine.add_request(p, SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True))
            for _ in range(8):  # past the prefills
                engine.step()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(8):
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        llm.shutdown()
    assert outs[True] == outs[False]


def test_block_tables_written_incrementally_match_the_lists():
    """Against a table built from scratch each step: appends, a preemption's new list, a list that is new
    every step (as through a pipe), released rows taken again, and growth in rows and width."""
    from turnout.engine.scheduler import ScheduledRequest
    from turnout.worker.block_table import BlockTables

    rng = random.Random(0)
    tables = BlockTables()
    lists: dict[str, list[int]] = {}
    for step in range(60):
        for req_id in rng.sample(sorted(lists), k=min(len(lists), rng.randint(0, 3))):
            del lists[req_id]
            tables.release([req_id])
        for _ in range(rng.randint(0, 12)):
            lists[f"r{step}-{rng.random()}"] = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
        for req_id, ids in list(lists.items()):
            kind = rng.random()
            if kind < 0.6:
                ids.extend(rng.randrange(1000) for _ in range(rng.randint(0, 4)))
            elif kind < 0.7:
                lists[req_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 5))]  # preempted
            elif kind < 0.8:
                lists[req_id] = list(ids)  # unpickled: the same ids in a new list
        sp = SamplingParams()
        reqs = [ScheduledRequest(k, [0], 0, (ids,), True, sp, [], []) for k, ids in lists.items()]
        if not reqs:
            continue
        got = tables(reqs)
        width = max(len(ids) for ids in lists.values())
        want = [ids + [0] * (width - len(ids)) for ids in lists.values()]
        assert got.tolist() == want, step
    assert len(tables.table) > 64 and tables.table.shape[1] > 16


def test_structured_outputs_keep_steps_in_flight(tiny_llama):
    """Constrained requests beside free ones (chunked prefill, preemption): the same tokens as sync, each
    constrained output inside its regex, and every step launched async: step N is read between N+1's
    forward and its sampling, so N+1's bitmask sees N's tokens."""
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 15)]
    rx = "(w7|w9)(w5|w8)(w6|w4)(w3|w2)(w7|w9)"  # each position its own tokens
    so = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": rx})
    sp = [so if i % 3 == 0 else SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)
          for i in range(len(prompts))]  # fmt: skip
    ref, _ = _run(tiny_llama, prompts, sp, async_scheduling=False)
    llm = LLM(str(tiny_llama), **SMALL, async_scheduling=True)
    ex, calls = llm.engine.executor, []
    step, step_async = ex.step, ex.step_async
    ex.step = lambda *a, **k: calls.append("sync") or step(*a, **k)
    ex.step_async = lambda *a, **k: calls.append("async") or step_async(*a, **k)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    llm.shutdown()
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == [r[:2] for r in ref]
    assert all(re.fullmatch(rx, outs[i].outputs[0].text.replace(" ", "")) for i in (0, 3, 6, 9))
    assert calls and set(calls) == {"async"}
