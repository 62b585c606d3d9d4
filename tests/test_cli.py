"""The turnout CLI, run as a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli

from turnout import hookimpl
from turnout.models.info import ModelInfo

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
    keys = {"name", "distribution", "version", "hooks", "status", "error", "unavailable_here"}
    assert all(set(r) == keys for r in rows)
    by = {r["name"]: r for r in rows}
    assert {"cpu", "graphs", "llama", "qwen3", "uniproc"} <= set(by)
    assert by["turnout_naive"]["status"] == "loaded" and by["turnout_naive"]["version"] == "1.2.3"
    assert by["turnout_broken"]["status"] == "failed" and "libfoo" in by["turnout_broken"]["error"]
    text = run("plugins", env=third_party).stdout
    assert "turnout_broken" in text and "failed" in text


@pytest.mark.slow
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
    p = run_cli("explain", "--model", str(tiny_llama), "--attention-backend", "nosuchbackend", check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: unknown attention backend 'nosuchbackend'")
    p = run_cli("explain", "--model", str(tiny_llama), "--attention-backend", "flashinfer", check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "'flashinfer' cannot be used: needs device cuda, have cpu" in last
    assert "valid here: cpu" in last
    p = run_cli("explain", "--model", str(tiny_llama), "--cudagraph-mode", "SOMETIMES", check=False)
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
    run_cli(
        "generate", "--model", str(tiny_llama), "--input", str(inp), "--output", str(out), "--max-tokens", "3"
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["w1 w2", "w9 w8 w7"] and all(r["token_ids"] for r in rows)


@pytest.mark.parametrize(
    "args, rc, needle",
    [
        (["--prompt", ""], 1, "prompt 0: empty prompt"),  # a prompt that fails is a failed row
        (["--prompt", "w1", "--temperature", "-1"], 2, "temperature must be >= 0"),
        (["--prompt", "w1", "--temperature", "inf"], 2, "temperature must be finite"),
        (["--prompt", "w1", "--top-p", "0"], 2, "top_p must be in (0, 1]"),
        (["--prompt", "w1", "--max-tokens", "0"], 2, "max_tokens must be >= 1"),
        (["--prompt", "w1", "--stop", ""], 2, "stop holds an empty string"),
        (
            ["--prompt", " ".join(["w1"] * 600)],
            1,
            "shorten the prompt to at most 511 tokens (the model's limit is 512)",
        ),
        (
            ["--prompt", "w1", "--max-tokens", "100000"],
            1,
            "context is 512 tokens, but the request needs 1 (prompt) + 100000 (max_tokens) = 100001",
        ),
        (["--prompt", "w1", "--max-tok", "3"], 2, "unrecognized arguments: --max-tok 3"),
        (["--prompt", "w1", "--block-size", "0"], 2, "'block_size' in arguments"),
    ],
)
def test_generate_bad_input_one_line_error(tiny_llama, args, rc, needle):
    p = run_cli("generate", "--model", str(tiny_llama), *args, check=False)
    assert p.returncode == rc
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in p.stderr, p.stderr


def test_generate_non_utf8_argument_is_one_usage_line(tiny_llama, capsys):
    """A shell passes bytes; Python holds those that are not UTF-8 as lone surrogates, as here."""
    from turnout import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tiny_llama), "--prompt", "caf\udce9"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "argument --prompt: b'caf\\xe9' is not UTF-8 text; pass UTF-8" in err[0]


def test_generate_missing_weights(tiny_llama, tmp_path):
    import shutil

    bad = tmp_path / "m"
    shutil.copytree(tiny_llama, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    p = run_cli("generate", "--model", str(bad), "--prompt", "w1", check=False)
    assert p.returncode == 2 and "model.safetensors" in p.stderr.strip().splitlines()[-1]
    (bad / "model.safetensors").unlink()
    p = run_cli("generate", "--model", str(bad), "--prompt", "w1", check=False)
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


# ---- the front door on the embedded model: real invocations ----


def test_output_is_jsonl_also_for_one_prompt(tmp_path):
    out = tmp_path / "out.jsonl"
    run_cli("generate", "--chat", "--prompt", "Say hi.", "--max-tokens", "4", "--output", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["id"] == 0 and rows[0]["prompt"] == "Say hi."
    assert rows[0]["finish_reason"] in ("stop", "length") and 0 < len(rows[0]["token_ids"]) <= 4
    assert isinstance(rows[0]["text"], str)


JSONL_ROWS = [
    '{"prompt": "Count from 1 to 5.", "max_tokens": 3, "ignore_eos": true}',
    '{"prompt": 42}',
    '{"prompt": null}',
    "this is not json",
    '{"messages": "not a list"}',
    '{"messages": [{"role": "user"}]}',
    '{"prompt": [1, 2, 3]}',
    '{"prompt": "Hi", "temprature": 0.5}',
    '{"id": "count", "messages": [{"role": "user", "content": "Count from 1 to 5."}], '
    '"max_tokens": 16, "stop": ["3"]}',
    "",
    '{"prompt": "Count from 1 to 5.", "max_tokens": 14}',
    '{"prompt": "Name a color.", "temperature": 1.0, "seed": 7, "max_tokens": 5, "n": 2, "logprobs": 1}',
    '{"prompt": "Hi", "seed": "abc"}',
    '{"prompt": "Hi", "temperature": Infinity}',
]


def test_jsonl_rows_apply_their_settings_and_fail_alone(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(JSONL_ROWS) + "\n")
    p = run_cli("generate", "--chat", "--input", str(inp), "--output", str(out), check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7, "count", 9, 10, 11, 12]
    errors = {r["id"]: r.get("error") for r in rows}
    assert [k for k, e in errors.items() if e is None] == [0, "count", 9, 10]
    expect = {
        1: "line 2: a prompt is text",
        2: "line 3: a prompt is text",
        3: "line 4: is not JSON",
        4: "line 5: messages must be a non-empty list",
        5: 'line 6: message 0 needs a "content" string',
        6: "line 7: a token-id prompt cannot take the chat template",
        7: "line 8: unknown key 'temprature'",
        11: "line 13: invalid SamplingParams: seed must be an integer",
        12: "line 14: invalid SamplingParams: temperature must be finite",
    }
    assert all(errors[k].startswith(v) for k, v in expect.items()), errors
    assert all(r["finish_reason"] == "error" and r["token_ids"] == [] for r in rows if r.get("error"))
    by = {r["id"]: r for r in rows}
    assert len(by[0]["token_ids"]) == 3 and by[0]["finish_reason"] == "length"  # max_tokens 3, not 64
    assert "3" not in by["count"]["text"] and (by["count"]["finish_reason"], by["count"]["stop_reason"]) == (
        "stop",
        "3",
    )
    assert "\n" in by[9]["text"] and len(by[9]["token_ids"]) == 14  # several lines, one JSON row
    assert len(by[10]["outputs"]) == 2 and all(
        len(c["logprobs"]) == len(c["token_ids"]) for c in by[10]["outputs"]
    )


def test_tp2_on_the_embedded_model_is_refused_before_any_worker():
    for cmd in (["explain"], ["generate", "--prompt", "hi"]):
        p = run(*cmd, "--tensor-parallel-size", "2", check=False)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and "Traceback" not in p.stderr and "multiproc: 2 ranks" not in p.stderr
        assert last.startswith("error: model ") and "does not divide the model's 9 attention heads" in last


# ---- in process: parsing, help text, explain's settings ----


def test_every_sampling_field_has_a_flag_and_seeds_are_split():
    from turnout import cli
    from turnout.engine_args import engine_config_from_args
    from turnout.sampling_params import SamplingParams

    args = cli.build_parser().parse_args(["generate", "--seed", "5", "--sampling-seed", "7", "--stop", "a"])
    assert engine_config_from_args(args).seed == 5  # --seed is the engine's, as in vLLM
    assert cli._sampling_defaults(args) == {"temperature": 0.0, "max_tokens": 64, "seed": 7, "stop": ["a"]}
    dests = {a.dest for a in cli.build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    missing = [
        f for f in SamplingParams.field_names() if ("sampling_seed" if f == "seed" else f) not in dests
    ]
    assert not missing


def test_help_states_exit_codes_defaults_and_dtype():
    from turnout import cli
    from turnout.config import EngineConfig
    from turnout.platform import Platform
    from turnout.sampling_params import SamplingParams

    gen = cli.build_parser()._subparsers._group_actions[0].choices["generate"]
    text = " ".join(gen.format_help().split())
    for code in sorted(cli.EXIT_CODES):
        assert re.search(rf"exit codes:.* {code} ", text), code
    for name, value in cli.CLI_SAMPLING_DEFAULTS.items():  # said plainly, and true of SamplingParams
        flag = re.search(
            rf"--{name.replace('_', '-')} \S+ default (\S+) .*?\(SamplingParams: ([\d.]+)\)", text
        )
        assert float(flag.group(1)) == value and float(flag.group(2)) == getattr(SamplingParams(), name)
    assert "on CPU bfloat16 for a bfloat16 checkpoint" in text and "else float32" in text
    info = ModelInfo(Path("m"), {"torch_dtype": "bfloat16"})
    for bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        cpu = Platform("cpu", "cpu", 1, None, 0, native_bf16=bf16)
        assert info.resolve_dtype(EngineConfig().dtype, cpu) == want


def test_explain_shows_settings_and_their_source(tiny_llama, tmp_path, monkeypatch, capsys):
    from turnout import cli

    cfg = tmp_path / "c.toml"
    cfg.write_text("block_size = 32\nmax_num_seqs = 4\n")
    monkeypatch.setenv("TURNOUT_MAX_MODEL_LEN", "128")
    argv = ["explain", "--json", "--model", str(tiny_llama), "--config", str(cfg), "--max-num-seqs", "8"]
    assert cli.main(argv) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["max_num_seqs"] == {"value": 8, "source": "flag"}
    assert settings["block_size"] == {"value": 32, "source": "file"}
    assert settings["max_model_len"] == {"value": 128, "source": "env"}
    fitted = {"value": 4096, "source": "fitted: CPU: vLLM's offline default"}
    assert settings["max_num_batched_tokens"] == fitted
    assert settings["enable_prefix_caching"] == {"value": True, "source": "default"}
    assert set(settings) == set(cli.EngineConfig.model_fields)
    assert cli.main(argv[:1] + argv[2:]) == 0
    out = capsys.readouterr().out
    assert "engine settings" in out and re.search(r"max_num_seqs +8 +flag", out)


def test_explain_on_a_gguf_writes_no_model(tmp_path, monkeypatch, capsys):
    from turnout import cli
    from turnout.loader.default_model import default_gguf_path

    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = default_gguf_path()
    assert cli.main(["explain", "--json", "--model", str(gguf)]) == 0
    assert not list(tmp_path.glob("cache/models/*"))  # read from the GGUF's metadata, not converted
    doc = json.loads(capsys.readouterr().out)
    assert (doc["model"], doc["architecture"]) == (str(gguf), "LlamaForCausalLM")
    assert doc["kinds"]["attention"]["chosen"] == "cpu"


class _NeedsLib:
    """A CPU attention backend whose library does not import."""

    @hookimpl
    def turnout_attention_backends(self, platform):
        from turnout.attention import AttentionBackend

        class NeedsLib(AttentionBackend):
            name, device_types, dtypes = "needslib", ("cpu",), (torch.float32,)

            def import_error(self):
                return "cannot import needslib: libfoo.so is missing"

            def forward(self, q, k, v, kv_cache, meta):
                raise NotImplementedError

        return [NeedsLib()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA backends can run here")
def test_plugins_say_which_components_cannot_run_here(register_plugin, capsys):
    from turnout import cli

    register_plugin(_NeedsLib(), "needslib")
    assert cli.main(["plugins", "--json"]) == 0
    by = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in ("flashinfer", "flash_attn"):
        assert by[name]["status"] == "loaded"
        assert by[name]["unavailable_here"] == [f"attention backend {name}: needs device cuda, have cpu"]
    assert by["needslib"]["unavailable_here"] == [
        "attention backend needslib: cannot import needslib: libfoo.so is missing"
    ]
    assert by["cpu"]["unavailable_here"] == by["uniproc"]["unavailable_here"] == []
    assert cli.main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: line for line in lines if line and not line.startswith(" ")}
    assert "loaded; unavailable here" in status["flashinfer"] and "unavailable" not in status["cpu"]
    assert re.search(
        r"^  flashinfer +attention backend flashinfer: needs device cuda, have cpu$", "\n".join(lines), re.M
    )


def test_file_errors_fail_before_the_model_loads(tmp_path, capsys):
    from turnout import cli

    assert cli.main(["generate", "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: cannot read --input {tmp_path / 'missing.jsonl'}: No such file or directory"
    )
    assert cli.main(["generate", "--prompt", "x", "--output", str(tmp_path / "no" / "o.jsonl")]) == 2
    assert "cannot write --output" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--input", str(tmp_path / "x")]) == 2


def test_version_abbreviations_and_a_missing_model(tiny_llama, tmp_path):
    from turnout import __version__

    assert run_cli("--version").stdout == f"turnout {__version__}\n"
    for args in (["tune"], ["bench", "throughput"]):  # subparsers built outside cli.py, too
        p = run_cli(*args, "--random-mod", "nosuch", check=False)
        assert p.returncode == 2 and "unrecognized arguments: --random-mod" in p.stderr, p.stderr
    for cmd in ("generate", "explain"):
        p = run_cli(cmd, "--model", str(tmp_path / "nope"), check=False)
        assert p.returncode == 2
        assert p.stderr.strip().splitlines()[-1] == (
            f"error: model {tmp_path / 'nope'} does not exist; pass an HF-style model folder or a .gguf file"
        )


def test_stop_flag_takes_escapes_as_typed():
    from turnout.cli import build_parser

    args = build_parser().parse_args(["generate", "--stop", "\\n", "--stop", "a\\tb\\\\n", "--stop", "\\x"])
    assert args.stop == ["\n", "a\tb\\n", "\\x"]


BAD_ROWS = [
    '{"id": "a", "prompt": "w1"}',
    "",
    '{"id": "b", "prompt": "w1", "bogus": 1}',
    '{"id": "c", "prompt": [' + ", ".join(["1"] * 600) + "]}",  # past the tiny model's 512 positions
    "not json",
    '{"id": 7, "prompt": ""}',
    '{"id": "e", "prompt": [1, 2], "temperature": -1}',
    '{"prompt": "w2"}',
]


def test_every_bad_jsonl_row_gets_one_stderr_line_with_its_line_and_id(tiny_llama, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(BAD_ROWS) + "\n")
    p = run_cli(
        "generate", "--model", str(tiny_llama), "--input", str(inp), "--output", str(out), check=False
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c", 3, 7, "e", 6]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert [e.split(":")[1] for e in errors] == [
        ' line 3 (id "b")',
        ' line 4 (id "c")',
        " line 5 (id 3)",
        " line 6 (id 7)",
        ' line 7 (id "e")',
    ], errors
    assert "unknown key 'bogus'" in errors[0] and "prompt is 600 tokens" in errors[1]
    assert "empty prompt" in errors[3] and "temperature must be >= 0" in errors[4]


def test_one_jsonl_prompt_shows_token_progress(tiny_llama, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "w1", "max_tokens": 5, "ignore_eos": true}\n')
    p = run_cli("generate", "--model", str(tiny_llama), "--input", str(inp))
    assert "generate: 100%" in p.stderr and "5/5" in p.stderr and "tok/s" in p.stderr
    assert len(json.loads(p.stdout)["token_ids"]) == 5


def _until(pred, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)


def _interrupted(tiny_llama, tmp_path, rows: list[dict], ready) -> tuple[int, str]:
    """generate --input rows --output out.jsonl, Ctrl-C once ready(the partial file's lines) holds."""
    inp, err = tmp_path / "in.jsonl", tmp_path / "err.txt"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "generate",
        "--model",
        str(tiny_llama),
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "out.jsonl"),
    ]
    # the console script, as a user runs it: under `python -m`, CPython 3.11 exits by SIGINT (-2, which a
    # shell also reports as 130) when the interrupt lands in exec'd code (a dataclass being made), caught
    # or not
    exe = str(Path(sys.executable).with_name("turnout"))
    with open(err, "w") as f:
        proc = subprocess.Popen([exe, *argv], stdout=f, stderr=f)
        parts = lambda: list(tmp_path.glob(".out.jsonl.*.part"))
        _until(lambda: parts() and ready(parts()[0].read_text().splitlines()))
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    assert not parts()
    return rc, err.read_text()


def test_a_ctrl_c_that_python_drops_still_stops_the_command(tmp_path):
    """A SIGINT that lands in an import lock's weakref callback is one Python prints and drops; here a
    plugin's import raises KeyboardInterrupt in a __del__, then works on."""
    source = "class Dying:\n    def __del__(self):\n        raise KeyboardInterrupt\n\n\nDying()\n"
    source += "__import__('time').sleep(5)\n"
    site = make_dist(tmp_path, "turnout-dying", "turnout_dying", source)
    p = run(
        "plugins",
        env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
        check=False,
    )
    assert p.returncode == 130 and p.stderr.splitlines()[-1] == "interrupted", p.stderr
    assert "Exception ignored" not in p.stderr, p.stderr


@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_rows_and_never_empties_the_output(tiny_llama, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    slow = {"id": "slow", "prompt": "w3", "max_tokens": 510, "ignore_eos": True, "n": 16, "temperature": 1.0}
    rc, err = _interrupted(tiny_llama, tmp_path, [slow], lambda lines: time.sleep(0.3) or True)  # no row done
    assert rc == 130 and "interrupted" in err.splitlines() and out.read_text() == "old\n", err
    quick = [{"id": f"q{i}", "prompt": "w1 w2", "max_tokens": 1} for i in range(3)]
    rows = [quick[0], slow, *quick[1:]]
    rc, err = _interrupted(tiny_llama, tmp_path, rows, lambda lines: len(lines) == 1)
    assert rc == 130 and "Traceback" not in err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["q0", "q1", "q2"]
