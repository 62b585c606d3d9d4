"""The turnout CLI, run as a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fake_dist import make_dist, naive_backend_source


def run(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "turnout.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
    if check:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def third_party(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    make_dist(root, "turnout-naive", "turnout_naive", naive_backend_source(priority=-5))
    make_dist(root, "turnout-broken", "turnout_broken", "raise ImportError('needs libfoo.so')\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def test_plugins_json_lists_in_repo_and_third_party(third_party):
    rows = json.loads(run("plugins", "--json", env=third_party).stdout)
    assert all(set(r) == {"name", "distribution", "version", "hooks", "status", "error"} for r in rows)
    by = {r["name"]: r for r in rows}
    assert {"cpu", "graphs", "llama", "qwen3", "uniproc"} <= set(by)
    assert by["turnout_naive"]["status"] == "loaded" and by["turnout_naive"]["version"] == "1.2.3"
    assert by["turnout_broken"]["status"] == "failed" and "libfoo" in by["turnout_broken"]["error"]
    text = run("plugins", env=third_party).stdout
    assert "turnout_broken" in text and "failed" in text


def test_explain_shows_all_kinds_and_config_choice(third_party, tiny_llama, tmp_path):
    doc = json.loads(run("explain", "--model", str(tiny_llama), "--json", env=third_party).stdout)
    att = doc["kinds"]["attention"]
    assert att["chosen"] == "cpu"  # naive has priority -5
    assert {c["name"] for c in att["candidates"]} >= {"cpu", "naive"}
    assert set(doc["kinds"]) == {"attention", "model", "executor", "graph"}
    assert doc["graph_mode"] == {
        "requested": "FULL_AND_PIECEWISE",
        "effective": "NONE",
        "reason": "CUDA graphs need a CUDA device, have cpu",
    }
    cfg = tmp_path / "t.yaml"
    cfg.write_text("attention_backend: naive\ncudagraph_mode: PIECEWISE\n")
    doc = json.loads(
        run("explain", "--model", str(tiny_llama), "--config", str(cfg), "--json", env=third_party).stdout
    )
    assert doc["kinds"]["attention"]["chosen"] == "naive"
    assert doc["graph_mode"]["requested"] == "PIECEWISE"
    text = run("explain", "--model", str(tiny_llama), env=third_party).stdout
    assert "attention backend (requested: auto)" in text and "graph mode: requested" in text


def test_explain_bad_choices_exit_nonzero_with_one_line(tiny_llama):
    p = run("explain", "--model", str(tiny_llama), "--attention-backend", "nosuchbackend", check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: unknown attention backend 'nosuchbackend'")
    p = run("explain", "--model", str(tiny_llama), "--attention-backend", "flashinfer", check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "'flashinfer' cannot be used: needs device cuda, have cpu" in last
    assert "valid here: cpu" in last
    p = run("explain", "--model", str(tiny_llama), "--cudagraph-mode", "SOMETIMES", check=False)
    assert p.returncode == 2 and "unknown graph policy 'SOMETIMES'" in p.stderr


def test_generate_json_and_generation_with_broken_plugin(third_party, tiny_llama):
    p = run(
        "generate", "--model", str(tiny_llama), "--prompt", "w1 w2 w3", "--prompt", "w4",
        "--max-tokens", "5", "--ignore-eos", "--json", env=third_party,
    )  # fmt: skip
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["w1 w2 w3", "w4"]
    assert all(len(r["token_ids"]) == 5 and r["text"] for r in rows)


def test_generate_input_jsonl(tiny_llama, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "w1 w2"}\n{"prompt": "w9 w8 w7"}\n')
    run(
        "generate", "--model", str(tiny_llama), "--input", str(inp), "--output", str(out), "--max-tokens", "3"
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["w1 w2", "w9 w8 w7"] and all(r["token_ids"] for r in rows)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", ""], "empty prompt"),
        (["--prompt", "w1", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "w1", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "w1", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--prompt", " ".join(["w1"] * 600)], "shorten the prompt or raise max_model_len"),
        (["--prompt", "w1", "--block-size", "0"], "'block_size' in arguments"),
    ],
)
def test_generate_bad_input_one_line_error(tiny_llama, args, needle):
    p = run("generate", "--model", str(tiny_llama), *args, check=False)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last


def test_generate_missing_weights(tiny_llama, tmp_path):
    import shutil

    bad = tmp_path / "m"
    shutil.copytree(tiny_llama, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    p = run("generate", "--model", str(bad), "--prompt", "w1", check=False)
    assert p.returncode == 2 and "model.safetensors" in p.stderr.strip().splitlines()[-1]
    (bad / "model.safetensors").unlink()
    p = run("generate", "--model", str(bad), "--prompt", "w1", check=False)
    assert p.returncode == 2 and "error:" in p.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_pip_installed_third_party_backend_is_listed_explained_and_chosen(tiny_llama, tmp_path):
    """The README's promise, end to end: pip install a backend package, pick it in a config file."""
    from pathlib import Path

    example = Path(__file__).parents[1] / "examples" / "turnout-example-backend"
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(example)], check=True, capture_output=True, timeout=300)
    env = {"PYTHONPATH": str(site)}
    rows = {r["name"]: r for r in json.loads(run("plugins", "--json", env=env).stdout)}
    assert rows["example_backend"]["distribution"] == "turnout-example-backend"
    assert rows["example_backend"]["status"] == "loaded"
    cfg = tmp_path / "turnout.toml"
    cfg.write_text('attention_backend = "naive"\n')
    doc = json.loads(run("explain", "--model", str(tiny_llama), "--json", env=env).stdout)
    assert doc["kinds"]["attention"]["chosen"] == "cpu" and "naive" in str(doc["kinds"]["attention"])
    doc = json.loads(
        run("explain", "--model", str(tiny_llama), "--config", str(cfg), "--json", env=env).stdout
    )
    assert doc["kinds"]["attention"]["chosen"] == "naive"
    args = [
        "generate",
        "--model",
        str(tiny_llama),
        "--prompt",
        "w5 w6 w7",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]
    with_naive = json.loads(run(*args, "--config", str(cfg), env=env).stdout)
    with_cpu = json.loads(run(*args, env=env).stdout)
    assert with_naive["token_ids"] == with_cpu["token_ids"] and len(with_cpu["token_ids"]) == 6
