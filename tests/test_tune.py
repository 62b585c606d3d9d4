"""turnout tune: real candidates measured on the CPU, the records' key, and the decision rule."""

from __future__ import annotations

import json
import re
import time
import types

import pytest
import torch

from turnout.cli import main
from turnout.config import EngineConfig
from turnout.llm import LLM
from turnout.models.info import ModelInfo
from turnout.platform import current_platform
from turnout.plugins import get_plugin_manager
from turnout.selection import select_all
from turnout.tuning import Measured, TuningRecord, decide, find_record, save, tune, tuning_key
from turnout.tuning.tuner import static_default
from turnout.tuning.workload import Load

from fake_dist import naive_backend_source

NAIVE_DIST = "turnout-example-backend"
SMALL = Load("throughput", 6, (16, 48), 12, vocab_size=512)  # 6 requests of 16-48 tokens, 12 out
DEFAULT = {
    "attention_backend": "triton",
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "max_num_batched_tokens": 16384,
    "block_size": 16,
    "async_scheduling": True,
}


@pytest.fixture
def naive(plugin_manager):
    """naive(version): the example backend, registered in-process as distribution turnout-example-backend
    at priority 100, so it is the static default (and about half as fast as cpu on the tiny model)."""
    mod = types.ModuleType("inproc_naive")
    exec(compile(naive_backend_source(priority=100), "inproc_naive", "exec"), mod.__dict__)

    def register(version: str = "1.2.3"):
        if plugin_manager.pm.has_plugin("naive_plugin"):
            plugin_manager.unregister("naive_plugin")
        plugin_manager.register(mod, "naive_plugin", NAIVE_DIST, version)
        return plugin_manager

    yield register
    if plugin_manager.pm.has_plugin("naive_plugin"):
        plugin_manager.unregister("naive_plugin")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty turnout cache; records go to its tuning/ folder."""
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path))
    return tmp_path / "tuning"


@pytest.fixture
def one_thread():
    """One intra-op thread while measuring: on a small CPU shared with other work, two threads stall each
    other's runs and the noise swamps every difference."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cand(label: str, runs: list[float], **changes) -> Measured:
    return Measured(label, {**DEFAULT, **changes}, runs)


def _record(*candidates: Measured) -> TuningRecord:
    return TuningRecord({}, "throughput", "tok/s", True, DEFAULT, [*candidates], 0.03, 10.0, [], "2026-12-01")


# ---- tune on real engines ----
@pytest.mark.slow
def test_tune_measures_real_candidates_and_selection_takes_the_recorded_winner(
    tiny_llama, naive, cache, one_thread
):
    naive()
    config = EngineConfig(model=str(tiny_llama), dtype="float32")
    axes = ("attention_backend", "max_num_batched_tokens")
    for _ in range(3):  # a noisy run is a correct no-decision on a shared CPU: measure again
        record = tune(config, budget=120, progress=False, load=SMALL, axes=axes)
        if decide(record, {}).winner is not None:
            break
    by = {c.label: c for c in record.candidates}
    assert record.default["attention_backend"] == "naive" and record.path.parent == cache
    # the default, its pairs that keep it for decode, the others by rank, their pairs: every time
    assert [c.label for c in record.candidates if "tokens" not in c.label] == [
        "naive",
        "naive+cpu",
        "cpu",
        "cpu+naive",
    ]
    assert sum(c.label.endswith(("tokens=2048", "tokens=8192")) for c in record.candidates) == 2
    assert all(len(c.runs) >= 2 for c in record.candidates) and by["cpu"].median > by["naive"].median
    assert TuningRecord.load(record.path) == record
    decision = decide(record, {})
    assert decision.winner is not None and decision.settings.get("attention_backend") in ("cpu", "cpu+naive")
    # measured tier (the lead's selection integration): a new engine of the same config takes the winner
    expected = {**record.default, **decision.settings}
    sel = select_all(config, ModelInfo.from_dir(tiny_llama))
    assert sel.attention.chosen.name == expected["attention_backend"]
    assert sel.apply(config).max_num_batched_tokens == expected["max_num_batched_tokens"]
    assert sel.measured.record.path == record.path


def test_tune_auto_tunes_an_unseen_key_once_before_the_engine(tiny_llama, cache, caplog, one_thread):
    for _ in range(2):
        LLM(str(tiny_llama), dtype="float32", tune="auto", tune_budget=3).shutdown()
    assert len(list(cache.glob("*.json"))) == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tune = auto")]
    assert "no tuning record matches" in lines[0] and "tuned in" in lines[1]
    assert "matches this setup; not tuning again" in lines[2]


def test_cli_tune_stays_within_its_budget_and_says_what_it_skipped(tiny_llama, cache, capsys):
    assert main(["tune", str(tiny_llama), "--dtype", "float32", "--budget", "0.01", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    budget = [s for s in doc["skipped"] if not s.startswith("kv_cache_dtype: not searched")]
    assert budget and all("over budget" in s for s in budget) and doc["candidates"] == []
    assert doc["decision"]["settings"] == {} and list(cache.glob("*.json"))


def test_cli_tune_bad_workload_is_one_line_exit_2(tiny_llama, cache, capsys):
    assert main(["tune", str(tiny_llama), "--workload", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown workload 'nope'") and "\n" not in err


def test_selection_takes_a_recorded_winner_but_a_user_setting_wins(tiny_llama, naive, cache):
    pm, info = naive(), ModelInfo.from_dir(tiny_llama)
    config = EngineConfig.load(model=str(tiny_llama), dtype="float32")
    default = {**DEFAULT, "attention_backend": "naive", "cudagraph_mode": "FULL_AND_PIECEWISE"}
    default |= {"max_num_batched_tokens": 4096, "async_scheduling": False}
    runs = {"naive": [2300.0, 2310.0], "cpu": [5000.0, 5010.0]}
    cands = [Measured(n, {**default, "attention_backend": n}, r) for n, r in runs.items()]
    key = tuning_key(config, info, current_platform(), pm, "throughput")
    save(TuningRecord(key, "throughput", "tok/s", True, default, cands, 0.03, 1.0, [], "2026-12-01"))
    assert select_all(config, info).attention.chosen.name == "cpu"  # measured: +117%
    pinned = EngineConfig.load(model=str(tiny_llama), dtype="float32", attention_backend="naive")
    assert select_all(pinned, info).attention.chosen.name == "naive"
    off = EngineConfig.load(model=str(tiny_llama), dtype="float32", tuned="off")
    assert select_all(off, info).attention.chosen.name == "naive"


# ---- the key ----
def test_a_changed_plugin_version_or_model_shape_leaves_the_record_unused(tiny_llama, naive, cache):
    pm, platform = naive("1.2.3"), current_platform()
    config, info = EngineConfig(model=str(tiny_llama), dtype="float32"), ModelInfo.from_dir(tiny_llama)

    def reasons(config=config, info=info, workload="throughput") -> list[str]:
        lookup = find_record(tuning_key(config, info, platform, pm, workload))
        return [] if lookup.record else lookup.reasons

    assert reasons() == [f"no tuning record in {cache}"]
    key = tuning_key(config, info, platform, pm, "throughput")
    path = save(TuningRecord(key, "throughput", "tok/s", True, DEFAULT, [], 0.03, 1.0, [], "2026-12-01"))
    assert find_record(key).record.path == path and reasons() == []
    wide = reasons(info=ModelInfo(info.path, {**info.hf_config, "hidden_size": 128}))
    assert str(path) in wide[0] and wide[0].endswith("differs: model hidden_size 64 -> 128")
    assert reasons(config=config.model_copy(update={"dtype": "bfloat16"}))[0].endswith(
        "model dtype float32 -> bfloat16"
    )
    assert reasons(workload="latency")[0].endswith("workload throughput -> latency")
    naive("1.2.4")
    assert reasons()[0].endswith(f"{NAIVE_DIST} 1.2.3 -> 1.2.4")


# ---- the decision rule ----
def test_a_candidate_within_the_margin_or_the_noise_keeps_the_default():
    base = _cand("triton", [8657, 8700, 8610])  # noise 1%
    within_margin = _cand("naive", [8760, 8770], attention_backend="naive")  # +1.2%
    d = decide(_record(base, within_margin), {})
    assert d.settings == {} and d.winner is None and d.baseline is base
    assert d.why == "measured: no candidate beats the default triton by more than 3% (best naive +1.2%)"
    noisy = _cand("flashinfer", [8400, 9800], attention_backend="flashinfer")  # +5.1%, noise 15.4%
    assert decide(_record(base, noisy), {}).settings == {}
    once = _cand("triton block=32", [20000], block_size=32)  # one run: no noise figure, not a candidate
    assert decide(_record(base, once), {}).settings == {}
    clear = _cand("triton+flash_attn", [9310, 9300, 9320], attention_backend="triton+flash_attn")  # +7.5%
    d = decide(_record(base, within_margin, noisy, clear), {})
    assert d.settings == {"attention_backend": "triton+flash_attn"} and d.winner is clear
    assert d.why == (
        "measured: triton+flash_attn 9,310 tok/s beats the default triton 8,657 tok/s by 7.5% "
        "(> margin 3%, noise 1%)"
    )


def test_a_user_setting_drops_the_candidates_that_disagree_and_moves_the_baseline():
    base = _cand("triton", [8657, 8700])
    pair = _cand("triton+flash_attn", [9310, 9320], attention_backend="triton+flash_attn")
    big_blocks = _cand("triton block=128", [9200, 9210], block_size=128)
    record = _record(base, pair, big_blocks)
    d = decide(record, {"attention_backend": "triton"})
    assert d.settings == {"block_size": 128} and d.winner is big_blocks and d.baseline is base
    d = decide(record, {"block_size": 128})  # the baseline is now triton at block 128: nothing beats it
    assert d.settings == {} and d.baseline is big_blocks
    d = decide(record, {"block_size": 64})
    assert d.baseline is None and d.why.startswith("measured: no decision")


def test_the_same_record_always_gives_the_same_decision():
    base = _cand("triton", [8000, 8010])
    a = _cand("flash_attn", [9000, 9010], attention_backend="flash_attn")
    b = _cand("triton block=128", [9000, 9010], block_size=128)  # a tie with a: broken by label
    first = decide(_record(base, b, a), {})
    assert first == decide(_record(base, b, a), {}) == decide(_record(base, a, b), {})
    assert first.winner.label == "flash_attn"


def test_the_latency_profile_counts_the_wait_for_the_first_token():
    """One request alone, scored from its arrival to its last token: a candidate that prefills slower loses
    latency even where it decodes as fast."""

    class Timed:  # an engine whose one request waits ttft_s for its first token, then tpot_s a token
        def __init__(self, ttft_s: float, tpot_s: float) -> None:
            self.ttft_s, self.tpot_s = ttft_s, tpot_s

        def generate(self, prompts, params, use_tqdm=False):
            assert len(prompts) == len(params) == 1
            n = params[0].max_tokens
            time.sleep(self.ttft_s + (n - 1) * self.tpot_s)
            return [types.SimpleNamespace(error=None, token_ids=[0] * n)]

    load = Load("latency", 1, (8, 8), 10, vocab_size=512)
    (req,) = load.requests(1)
    assert len(req.prompt) == 8 and req.max_tokens == 10
    fast, slow = (load.run(Timed(ttft, 0.01), [req]) for ttft in (0.02, 0.2))
    assert fast == pytest.approx(10 / (0.02 + 9 * 0.01), rel=0.2)
    assert slow == pytest.approx(10 / (0.2 + 9 * 0.01), rel=0.2) and slow < 0.6 * fast


def test_the_budget_expects_each_candidate_to_cost_as_much_as_the_slowest_before_it(tiny_llama):
    from turnout.tuning.tuner import Search

    config = EngineConfig(model=str(tiny_llama), dtype="float32", tuned="off")
    search = Search(config, ModelInfo.from_dir(tiny_llama), SMALL, 2, 10.0, False, time.perf_counter() - 6)
    search.costs = [5.0, 1.0, 2.0]  # the first read the weights; 2 s fit the 4 s left
    assert search.unfit([]) == ""
    search.costs = [5.0, 1.0, 4.5]  # a mean of 2.75 s would fit; the slowest, 4.5 s, does not
    assert search.unfit([]).startswith("over budget")
    search.close()


def test_a_pair_baseline_leads_the_attention_candidates_with_its_decode_half(tiny_llama, naive):
    """auto's baseline can be a decode+mixed pair: the candidates start with its decode half and the pairs
    that keep it, not with whichever single backend ranks first."""
    from turnout.tuning.tuner import Search

    naive()  # priority 100: the first single backend by rank
    config = EngineConfig(model=str(tiny_llama), dtype="float32", tuned="off")
    search = Search(config, ModelInfo.from_dir(tiny_llama), SMALL, 2, 10.0, False)
    assert list(search.backends)[0] == "naive" and "cpu" in search.backends
    names = search.backend_names("cpu+naive")
    assert names[0] == "cpu" and names[1].startswith("cpu+")
    assert names.index("naive") > max(i for i, n in enumerate(names) if n.startswith("cpu+"))
    search.close()


def test_a_winner_needs_runs_that_agree():
    """A candidate whose runs spread past MAX_NOISE measured a busy machine: even a median far ahead of the
    default's does not win, and the decision says why."""
    base = _cand("triton", [8000, 8010, 8020])
    outlier = _cand("flash_attn", [8000, 30000, 30000], attention_backend="flash_attn")  # +274%, noise 73%
    d = decide(_record(base, outlier), {})
    assert d.settings == {} and d.winner is None and d.baseline is base
    assert d.why == (
        "measured: no decision: flash_attn's runs spread by 73.3% (over 25%), a busy machine; "
        "tune again when it is quieter"
    )


def test_the_progress_bar_counts_runs_from_its_first_frame(tiny_llama):
    from turnout.tuning.tuner import Search

    config = EngineConfig(model=str(tiny_llama), dtype="float32", tuned="off")
    search = Search(config, ModelInfo.from_dir(tiny_llama), SMALL, 2, 10.0, True)
    try:
        assert str(search.bar).startswith("tune: 0/0 runs ["), str(search.bar)
        search.bar.total += 4
        search.bar.update(1)
        assert str(search.bar).startswith("tune: 1/4 runs ["), str(search.bar)
    finally:
        search.close()


def test_tune_scores_no_warm_up_and_keeps_the_best_engine_across_axes(
    tiny_llama, cache, monkeypatch, one_thread, capsys
):
    """Every engine runs once when built and once more when its axis's engines are all built, unscored;
    then each of the rounds is scored. The current best's engine goes on to the next axis, not rebuilt.
    The progress bar names the axis and counts the scored runs."""
    runs: dict[int, int] = {}
    builds, alive = [], []  # alive: no engine's id is reused by the next

    class Counted(Load):
        def run(self, llm, reqs):
            alive.append(llm)
            runs[id(llm)] = runs.get(id(llm), 0) + 1
            return super().run(llm, reqs)

    init = LLM.__init__
    monkeypatch.setattr(LLM, "__init__", lambda self, *a, **k: (builds.append(1), init(self, *a, **k))[1])
    load = Counted("throughput", 2, (8, 8), 4, vocab_size=512)
    config = EngineConfig(model=str(tiny_llama), dtype="float32")
    record = tune(config, budget=120, progress=True, load=load, axes=("max_num_batched_tokens", "block_size"))
    frames = [f.strip() for f in capsys.readouterr().err.split("\r") if f.strip().startswith("tune")]
    assert frames[-1].startswith("tune block_size: 10/10 runs [") and all(
        re.fullmatch(r"tune( \w+)?: \d+/\d+ runs \[.*", f) for f in frames
    ), frames
    assert not record.skipped, record.skipped
    labels = [c.label for c in record.candidates]
    assert labels[:3] == ["cpu", "cpu tokens=2048", "cpu tokens=8192"] and labels[3].endswith("block=32")
    assert len(builds) == 4  # the tokens axis's best measured on the next axis too, built once
    kept = 1 + 2 * (1 + 2)  # its build's warm-up, then per axis an unscored round and 2 scored rounds
    assert sorted(runs.values()) == [4, 4, 4, kept]
    assert sorted(len(c.runs) for c in record.candidates) == [2, 2, 2, 4]


# ---- the KV cache dtype: measured only where the user lists it ----
def test_tune_measures_kv_cache_dtypes_only_where_the_user_lists_them(tiny_llama, cache, one_thread):
    """Without a list the record holds only the default cache (auto) and says the axis was not searched;
    with --kv-cache-dtype auto,fp8 both caches are measured, each twice, and the record names them."""
    config = EngineConfig(model=str(tiny_llama), dtype="float32")
    axes = ("kv_cache_dtype", "max_num_batched_tokens")
    plain = tune(config, budget=120, progress=False, load=SMALL, axes=axes)
    assert plain.default["kv_cache_dtype"] == "auto"
    assert {c.settings["kv_cache_dtype"] for c in plain.candidates} == {"auto"}
    assert any(s.startswith("kv_cache_dtype: not searched") for s in plain.skipped), plain.skipped
    listed = tune(config, budget=120, progress=False, load=SMALL, axes=("kv_cache_dtype",),
                  kv_cache_dtypes=("auto", "fp8_e4m3"))  # fmt: skip
    by = {c.label: c for c in listed.candidates}
    assert set(by) == {"cpu", "cpu kv=fp8"} and all(len(c.runs) >= 2 for c in by.values()), by
    assert by["cpu kv=fp8"].settings["kv_cache_dtype"] == "fp8"
    assert TuningRecord.load(listed.path) == listed


def test_a_recorded_kv_cache_dtype_is_applied_said_and_a_user_setting_wins(tiny_llama, cache, capsys):
    """A record (from a listed tune) in which fp8 wins sets the cache dtype of an engine that leaves it
    auto, and explain says it came from tuning; a user's kv_cache_dtype wins over the record."""
    config = EngineConfig.load(model=str(tiny_llama), dtype="float32")
    info = ModelInfo.from_dir(tiny_llama)
    default = static_default(select_all(config, info), config)
    runs = {"auto": [2300.0, 2310.0], "fp8": [5000.0, 5010.0]}
    cands = [Measured(f"cpu kv={k}", {**default, "kv_cache_dtype": k}, r) for k, r in runs.items()]
    key = tuning_key(config, info, current_platform(), get_plugin_manager(), "throughput")
    assert default["kv_cache_dtype"] == "auto"
    save(TuningRecord(key, "throughput", "tok/s", True, default, cands, 0.03, 1.0, [], "2026-12-01"))
    sel = select_all(config, info)
    assert sel.kv_cache_dtype == "fp8" and sel.kv_cache_note.startswith("tuned: measured, record "), sel
    assert main(["explain", "--model", str(tiny_llama), "--dtype", "float32", "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache_dtype"]
    assert (kv["requested"], kv["chosen"], kv["dtype"]) == ("auto", "fp8", "float8_e4m3fn"), kv
    assert kv["why"].startswith("tuned: measured, record "), kv
    assert main(["explain", "--model", str(tiny_llama), "--dtype", "float32"]) == 0
    assert "KV cache: float8_e4m3fn (kv_cache_dtype fp8: tuned: measured, record " in capsys.readouterr().out
    runs["auto"], runs["fp8"] = runs["fp8"], runs["auto"]  # the user's fp8 where auto wins: fp8 stays
    cands = [Measured(f"cpu kv={k}", {**default, "kv_cache_dtype": k}, r) for k, r in runs.items()]
    save(TuningRecord(key, "throughput", "tok/s", True, default, cands, 0.03, 1.0, [], "2026-12-02"))
    assert select_all(config, info).kv_cache_dtype == "auto"
    mine = EngineConfig.load(model=str(tiny_llama), dtype="float32", kv_cache_dtype="fp8")
    assert select_all(mine, info).kv_cache_dtype == "fp8"


@pytest.mark.parametrize(
    "flag,needle",
    [("auto,int8", "candidate 'int8' is not one of auto, fp8, fp8_e4m3"), ("fp8,fp8_e4m3", "name one dtype")],
)
def test_cli_tune_bad_kv_cache_dtype_list_is_one_line_exit_2(tiny_llama, cache, capsys, flag, needle):
    assert main(["tune", str(tiny_llama), "--kv-cache-dtype", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
