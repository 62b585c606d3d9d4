"""`turnout explain` says why every candidate lost; building an LLM logs its choices in one line."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from turnout import LLM
from turnout.cli import main
from turnout.platform import Platform

from fake_dist import naive_backend_source


@pytest.fixture
def naive(register_plugin):
    mod = types.ModuleType("inproc_naive")
    exec(compile(naive_backend_source(priority=-5), "inproc_naive", "exec"), mod.__dict__)
    register_plugin(mod, "naive_plugin")


def _rows(text: str, section: str) -> dict[str, str]:
    """candidate name -> its table row, in the section that starts with `section`."""
    block = text.split(section, 1)[1].split("\n\n", 1)[0]
    return {line.split()[0]: line for line in block.splitlines()[2:]}


def test_explain_says_why_each_valid_candidate_lost(naive, tiny_llama, capsys):
    assert main(["explain", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    att = _rows(out, "attention backend (requested: auto)")
    assert "why not chosen" in out
    assert att["naive"].endswith("priority -5 < cpu 0") and att["cpu"].rstrip().endswith("*")
    assert "needs device cuda, have cpu" in att["flashinfer"]  # invalid: its reasons instead
    graphs = _rows(out, "graph policy (requested: FULL_AND_PIECEWISE)")
    assert graphs["NONE"].endswith("not requested (cudagraph_mode = FULL_AND_PIECEWISE)")
    assert main(["explain", "--model", str(tiny_llama), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lost = {c["name"]: c["lost"] for c in doc["kinds"]["attention"]["candidates"]}
    assert lost["naive"] == "priority -5 < cpu 0" and lost["cpu"] is None and lost["flashinfer"] is None


def test_llm_logs_its_choices_in_one_line(tiny_llama, caplog):
    llm = LLM(str(tiny_llama), cpu_kv_cache_bytes=1 << 22)
    llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("selected ")]
    assert lines == [
        "selected attention cpu (cpu), model LlamaForCausalLM (llama), executor uniproc (uniproc), "
        "graph mode FULL_AND_PIECEWISE -> NONE, cpu float32"
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.getMessage() in lines)


def test_explain_shows_fitted_settings_and_why(tiny_llama, capsys):
    assert main(["explain", "--model", str(tiny_llama), "--block-size", "32", "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    fitted = {"value": 4096, "source": "fitted: CPU: vLLM's offline default"}
    assert settings["max_num_batched_tokens"] == fitted
    assert settings["block_size"] == {"value": 32, "source": "flag"}
    assert main(["explain", "--model", str(tiny_llama)]) == 0
    rows = _rows(capsys.readouterr().out, "engine settings")
    assert rows["block_size"].split()[1] == "16" and "fitted: cpu's preferred" in rows["block_size"]


def test_explain_shows_what_the_engine_will_use(tiny_llama, capsys):
    """Settings left to the engine (unset, "auto", a downgraded graph mode) show the value the engine built
    from the same flags runs with, and where it came from."""
    kv = ["--cpu-kv-cache-bytes", str(1 << 22)]
    assert main(["explain", "--model", str(tiny_llama), *kv, "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    llm = LLM(str(tiny_llama), cpu_kv_cache_bytes=1 << 22)
    try:
        weights = next(llm.engine.executor.worker.runner.model.parameters()).dtype
        assert settings["max_model_len"]["value"] == llm.engine.max_model_len == 512
    finally:
        llm.shutdown()
    hf = json.loads((tiny_llama / "config.json").read_text())
    saved = hf.get("torch_dtype") or hf["dtype"]
    assert settings["dtype"] == {"value": str(weights).removeprefix("torch."), "source": f"default auto: the "
                                 f"checkpoint's {saved}"}  # fmt: skip
    assert settings["max_model_len"]["source"].startswith(
        "default unset: the model's max_position_embeddings"
    )
    assert settings["attention_backend"] == {"value": "cpu", "source": "default auto: selection (see above)"}
    assert (
        settings["cudagraph_mode"]["value"] == "NONE"
        and "downgraded, " in settings["cudagraph_mode"]["source"]
    )
    assert settings["tokenizer"]["value"] == str(tiny_llama) and settings["moe_kernel"]["value"] == "none"


def _settings(*argv: str, capsys) -> dict:
    assert main(["explain", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["settings"]


def test_explain_shows_max_num_seqs_fitted_to_the_device_unless_set(tiny_llama, monkeypatch, capsys):
    """max_num_seqs as the engine resolves it: vLLM's LLM default for the device, and why, or the user's."""
    model = ["--model", str(tiny_llama)]
    cpu = {"value": 256, "source": "fitted: CPU: vLLM's offline default 256"}
    assert _settings(*model, capsys=capsys)["max_num_seqs"] == cpu
    assert _settings(*model, "--max-num-seqs", "8", capsys=capsys)["max_num_seqs"] == {
        "value": 8,
        "source": "flag",
    }
    h200 = Platform(
        "cuda", "NVIDIA H200", 1, (9, 0), 141 << 30, (torch.float16, torch.bfloat16, torch.float32), True
    )
    monkeypatch.setattr("turnout.selection.pipeline.current_platform", lambda: h200)
    gpu = {"value": 1024, "source": "fitted: GPU with 141 GiB (>= 70): vLLM's offline default 1024"}
    assert _settings(*model, capsys=capsys)["max_num_seqs"] == gpu
    assert _settings(*model, "--enforce-eager", capsys=capsys)["max_num_seqs"] == gpu
    pp = _settings(*model, "--pipeline-parallel-size", "2", capsys=capsys)
    assert pp["max_num_seqs"] == gpu and pp["cudagraph_mode"]["value"] == "NONE"
    assert "pipeline_parallel_size 2: stages run eager" in pp["cudagraph_mode"]["source"]
    capped = _settings(*model, "--max-num-batched-tokens", "512", capsys=capsys)["max_num_seqs"]
    assert capped["value"] == 512 and "capped at max_num_batched_tokens 512" in capped["source"]
    assert _settings(*model, "--max-num-seqs", "300", capsys=capsys)["max_num_seqs"] == {
        "value": 300,
        "source": "flag",
    }


def test_a_tuning_record_that_measured_max_num_seqs_wins_over_the_fitted_one_but_not_the_users(
    tiny_llama, tmp_path, monkeypatch, capsys
):
    from turnout.config import EngineConfig
    from turnout.models.info import ModelInfo
    from turnout.platform import current_platform
    from turnout.plugins import get_plugin_manager
    from turnout.tuning import Measured, TuningRecord, save, tuning_key

    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path))
    config, info = EngineConfig.load(model=str(tiny_llama)), ModelInfo.from_dir(tiny_llama)
    default = {"attention_backend": "cpu", "cudagraph_mode": "FULL_AND_PIECEWISE", "block_size": 16,
               "max_num_batched_tokens": 4096, "async_scheduling": False, "max_num_seqs": 256}  # fmt: skip
    cands = [Measured("cpu", default, [1000.0, 1010.0]),
             Measured("cpu seqs=512", {**default, "max_num_seqs": 512}, [3000.0, 3010.0])]  # fmt: skip
    key = tuning_key(config, info, current_platform(), get_plugin_manager(), "throughput")
    path = save(TuningRecord(key, "throughput", "tok/s", True, default, cands, 0.03, 1.0, [], "2026-12-01"))
    model = ["--model", str(tiny_llama)]
    measured = {"value": 512, "source": f"fitted: measured, record {path.name}"}
    assert _settings(*model, capsys=capsys)["max_num_seqs"] == measured
    assert _settings(*model, "--max-num-seqs", "8", capsys=capsys)["max_num_seqs"] == {
        "value": 8,
        "source": "flag",
    }
