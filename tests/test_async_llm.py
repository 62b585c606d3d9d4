"""AsyncLLM with its engine core in a process of its own and in a thread: the same tokens as LLM.generate,
messages that survive the socket, incremental text equal to decode, and a start-up error that reaches the
user as one line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from turnout import LLM, SamplingParams
from turnout.config import EngineConfig
from turnout.engine import serial
from turnout.engine.async_llm import AsyncLLM
from turnout.engine.messages import CoreBatch, EngineDeadError, EngineOutput, EngineRequest, SchedulerStats
from turnout.errors import ConfigError, RequestError, TurnoutError

from procs import alive

KW = {"cpu_kv_cache_bytes": 16 << 20, "block_size": 8, "max_model_len": 256}


def test_messages_survive_the_socket() -> None:
    params = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=5, seed=(1 << 64) - 1, max_tokens=9, stop=["\n\n", "é"],
        stop_token_ids=[3], logit_bias={7: -1.5}, bad_words=["x y"], logprobs=2, skip_special_tokens=False,
    )  # fmt: skip
    add = ("add", [EngineRequest("a", [1, 2, 3], params), EngineRequest("b", [4], SamplingParams())], 17)
    got = serial.decode_command(serial.encode_command(add))
    assert got[0] == "add" and got[2] == 17
    assert [(r.req_id, r.prompt_token_ids, r.params) for r in got[1]] == [
        (r.req_id, r.prompt_token_ids, r.params) for r in add[1]
    ]
    for cmd in (("abort", ["a", "b"]), ("drain", 12.5), ("stop",)):
        assert serial.decode_command(serial.encode_command(cmd)) == cmd

    outs = [
        EngineOutput("a", 5, (-0.25, [(5, -0.25), (6, -2.0)]), "hé", None),
        EngineOutput("b", 9, None, None, "stop", "all of it", 4),
        EngineOutput("c", 7, None),
    ]
    stats = SchedulerStats(3, 1, 0.5, 100, 40, 2)
    batch = CoreBatch(
        1.5, [(1, None), (2, RequestError("prompt too long"))], outs, stats, EngineDeadError("x")
    )
    back = serial.decode_batch(serial.encode_batch(batch))
    assert (back.time, back.stats, back.outputs[1:]) == (1.5, stats, outs[1:])
    assert back.outputs[0].logprobs == [-0.25, [[5, -0.25], [6, -2.0]]] and back.outputs[0].text == "hé"
    (k1, e1), (k2, e2) = back.acks
    assert (k1, e1, k2, type(e2), str(e2)) == (1, None, 2, RequestError, "prompt too long")
    assert type(back.fail) is EngineDeadError and str(back.fail) == "x"
    other = serial.decode_error(serial.encode_error(RuntimeError("CUDA out of memory\nmore")))
    assert type(other) is TurnoutError and str(other) == "RuntimeError: CUDA out of memory"


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_decode(skip: bool) -> None:
    """Token by token, the Detokenizer's text is tokenizer.decode of all the ids (special tokens too)."""
    import random

    from transformers import AutoTokenizer

    from turnout.engine.detokenizer import Detokenizer
    from turnout.loader.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        d = Detokenizer(tok, skip)
        for k in range(1, len(ids) + 1):
            d.step(ids[:k], final=k == len(ids))
        assert d.text == tok.decode(ids, skip_special_tokens=skip), ids


async def _generate(model: Path, multiprocessing: bool, prompts: list[list[int]], sp: SamplingParams) -> dict:
    llm = AsyncLLM(EngineConfig(model=str(model), **KW), multiprocessing=multiprocessing)
    proc = getattr(llm.client, "proc", None)
    try:
        assert llm.core_location == (f"process (pid {proc.pid})" if multiprocessing else "thread")
        assert llm.max_model_len == 256 and llm.info.executor == "uniproc"
        llm.start()
        reqs = [EngineRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)]
        tokens: dict[str, list[int]] = {r.req_id: [] for r in reqs}
        texts: dict[str, str | None] = {}
        with await llm.generate(reqs) as stream:
            async for outs in stream:
                for o in outs:
                    tokens[o.req_id].append(o.token_id)
                    if o.finish_reason:
                        texts[o.req_id] = o.final_text
        with pytest.raises(RequestError, match="already in use"):  # the core's rejection, by its class
            await llm.generate([EngineRequest("r0", [5], sp), EngineRequest("r0", [6], sp)])
    finally:
        llm.shutdown()
    if proc is not None:
        assert not alive(proc.pid)
    return {k: [v[f"r{i}"] for i in range(len(prompts))] for k, v in (("tokens", tokens), ("texts", texts))}


def test_core_in_a_process_and_in_a_thread_match_llm_generate(tiny_llama: Path) -> None:
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama), **KW)
    ref = llm.generate(prompts, sp, use_tqdm=False)
    llm.shutdown()
    for mp in (True, False):
        got = asyncio.run(_generate(tiny_llama, mp, prompts, sp))
        assert got["tokens"] == [r.token_ids for r in ref], mp
        assert got["texts"] == [r.text for r in ref]


@pytest.mark.slow
def test_start_up_error_in_the_core_process_is_one_line(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="max_model_len 100000 exceeds the model's"):
        AsyncLLM(EngineConfig(model=str(tiny_llama), **{**KW, "max_model_len": 100000}))
    cmd = [sys.executable, "-m", "turnout.cli", "serve", str(tiny_llama), "--max-model-len", "100000"]
    r = subprocess.run([*cmd, "--port", "0"], capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if not x.startswith("INFO ")]  # the engine's start-up log
    assert r.returncode == 2 and lines == ["error: max_model_len 100000 exceeds the model's 512; lower it"], (
        r.stderr
    )
