"""turnout.bench's ways into a running engine: every stage of STAGES wraps a method a real engine runs,
leaves its outputs alone and is put back afterwards; memory_reports counts the checkpoint's weights."""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
from safetensors import safe_open

from turnout import LLM, SamplingParams, TurnoutError
from turnout.bench import STAGES, memory_reports, stages

PROMPTS = [[5, 9, 14, 3, 8], [7, 7, 21]]
NEW = 6


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_llama: Path):
    llm = LLM(
        str(tiny_llama), dtype="float32", attention_backend="cpu", max_model_len=64,
        async_scheduling=request.param,
    )  # fmt: skip
    yield llm
    llm.shutdown()


def greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def counted(llm: LLM) -> tuple[list[list[int]], Counter, list[tuple]]:
    """The greedy outputs with every stage wrapped, each stage's calls, and execute's arguments."""
    calls, executes = Counter(), []

    def around(name: str, args: tuple):
        calls[name] += 1
        if name == "execute":
            executes.append(args)
        return nullcontext() if calls[name] % 2 else None  # both kinds of answer

    with stages(llm, around):
        out = greedy(llm)
    return out, calls, executes


def test_every_stage_runs_and_outputs_do_not_change(llm: LLM):
    plain = greedy(llm)
    out, calls, executes = counted(llm)
    assert out == plain
    async_only = set() if llm.selection.async_scheduling else {"fill"}
    assert set(calls) == set(STAGES) - async_only
    assert calls["add_request"] == len(PROMPTS)
    decodes = [a for a in executes if a[0].requests and all(len(r.token_ids) == 1 for r in a[0].requests)]
    assert len(decodes) == NEW - 1  # both prompts prefill in one step, then decode together
    assert calls["sample"] == calls["execute"] >= NEW


def test_the_methods_are_put_back(llm: LLM):
    engine_cls = type(llm.engine)
    before = {c: dict(vars(c)) for c in engine_cls.__mro__}
    with stages(llm, lambda name, args: None, ["step", "model"]):
        assert engine_cls.step is not before[engine_cls]["step"]
    assert {c: dict(vars(c)) for c in engine_cls.__mro__} == before
    assert counted(llm)[0] == greedy(llm)  # a second wrap over the restored methods


def test_an_unknown_stage_is_named(llm: LLM):
    with pytest.raises(TurnoutError, match="no stage 'forwards'; the stages are step, add_request"):
        with stages(llm, lambda name, args: None, ["forwards"]):
            pass


def test_memory_reports_count_the_checkpoints_weights(llm: LLM, tiny_llama: Path):
    with safe_open(tiny_llama / "model.safetensors", "pt") as f:
        nbytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # float32
    (report,) = memory_reports(llm)
    assert report["weight_bytes"] == nbytes
    assert report["kv_cache_bytes"] > 0
