"""`turnout explain` says why every candidate lost; building an LLM logs its choices in one line."""

from __future__ import annotations

import json
import logging
import types

import pytest

from turnout import LLM
from turnout.cli import main

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
