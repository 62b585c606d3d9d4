"""The start-up warm-up runs synthetic requests through the real step path and leaves no trace: the same
tokens afterwards, every KV block free, no prefix-cache entry or statistic, no per-request worker state."""

from __future__ import annotations

import logging
import re

import pytest

from turnout import LLM, SamplingParams

PROMPTS = [[5, 9, 14, 3, 7], list(range(40, 75)), [11] * 20]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_leaves_no_trace(tiny_llama, async_scheduling):
    """With async scheduling too, where a step is in flight while the warm-up's requests finish."""
    kw = dict(
        dtype="float32", max_model_len=64, enforce_eager=True, attention_backend="cpu",
        async_scheduling=async_scheduling,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = LLM(str(tiny_llama), **{**kw, "async_scheduling": False})  # the reference: sync
    expected = [o.token_ids for o in cold.generate(PROMPTS, params, use_tqdm=False)]

    llm = LLM(str(tiny_llama), **kw)
    engine = llm.engine
    hits, new_scheduler = [], engine._new_scheduler
    engine._new_scheduler = lambda: (hits.append(engine.scheduler.bm.stats.hits), new_scheduler())[1]
    engine._warm_up()
    assert hits[0] > 0  # a prefill after a cached prefix ran (and compiled its kernels on CUDA)
    bm = engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.stats()["prefix_cache_queries"] == 0 and not engine.requests
    runner = engine.executor.worker.runner
    assert not runner.generators  # the seeded warm-up request's generator is gone
    assert (
        not any(t.rows for t in runner.block_tables)
        and runner._last_sampled is None
        and engine._in_flight is None
    )
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_warm_up_requests_fit_the_context(tiny_llama):
    """The warm-up's longest request fits max_model_len, past which a request is refused before it runs."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, enforce_eager=True, attention_backend="cpu")
    llm.engine._warm_up()  # start-up runs it on CUDA only
    assert not llm.engine.requests
    with pytest.raises(ValueError, match=r"prompt 0: this model's context is 64 tokens, .* = 70;"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)


def test_warm_up_stops_at_the_token_budget(tiny_llama, caplog):
    """Bands of sequence length end at max_num_batched_tokens: longer prompts run in chunks of the budget."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=64, attention_backend="cpu")
    try:
        assert llm.engine.max_model_len > 64
        with caplog.at_level(logging.INFO, logger="turnout"):
            llm.engine._warm_up()
        done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: ")]
        assert len(done) == 1 and re.fullmatch(
            r"warm-up: \d+ steps up to 64 tokens and \d+ requests in [\d.]+s", done[0]
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_runs_the_widest_batch(tiny_llama, caplog, async_scheduling):
    """A step of max_num_seqs requests (decode rows beside a new prompt) runs before any user request."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=12, max_model_len=64, attention_backend="cpu",
              enforce_eager=True, async_scheduling=async_scheduling)  # fmt: skip
    try:
        with caplog.at_level(logging.INFO, logger="turnout"):
            llm.engine._warm_up()
        done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: ")]
        assert len(done) == 1 and " and 12 requests in " in done[0], done
        assert llm.engine.scheduler.bm.num_free_blocks == llm.engine.scheduler.bm.num_blocks
    finally:
        llm.shutdown()
