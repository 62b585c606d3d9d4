"""Fuzzing the CLI and its JSONL input, in process, on the embedded model (a few tokens per prompt): no
traceback ever reaches stderr or the log, every exit code is a documented one, every non-blank input line
gets exactly one output row in input order, and the engine is left with no request behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from hypothesis import given
from hypothesis import strategies as st

import turnout.llm
from turnout import LLM, cli
from turnout.sampling_params import SamplingParams

from fuzzing import fuzz

pytestmark = pytest.mark.slow  # hypothesis drives the CLI in process, example by example

VOCAB = 49152
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 0),
    st.lists(st.one_of(st.integers(), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
)
# values a row may give each SamplingParams field: small enough that a valid row costs a few tokens
VALID = {
    "n": st.integers(1, 2),
    "best_of": st.none() | st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 60),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**64 - 1),
    "max_tokens": st.integers(1, 3),
    "min_tokens": st.integers(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 5), max_size=2),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB + 5).map(str), st.floats(-10, 10), max_size=3),
    "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=2),
    "logprobs": st.none() | st.integers(0, 22),
    "prompt_logprobs": st.none() | st.integers(0, 2),
    "skip_special_tokens": st.booleans(),
    "structured_outputs": st.none()
    | st.fixed_dictionaries({"regex": st.sampled_from(["(w1|w2)+", "w[0-9]", "("])})
    | st.fixed_dictionaries(
        {"choice": st.lists(st.sampled_from(["w3", "w4 w5", "ab"]), min_size=1, max_size=2)}
    ),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(max_size=12)},
    optional={"name": st.text(max_size=3)},
)
PROMPT = st.one_of(st.text(max_size=24), st.lists(st.integers(0, VOCAB + 5), max_size=6), JUNK)
MESSAGES = st.one_of(
    st.lists(MESSAGE, min_size=1, max_size=2), st.lists(st.one_of(MESSAGE, JUNK), max_size=2), JUNK
)
SETTINGS = st.fixed_dictionaries(
    {}, optional={k: st.one_of(v, v, JUNK) for k, v in VALID.items()} | {"temprature": st.floats(0, 1)}
)
ID = st.one_of(st.text(max_size=4), st.integers(-5, 5), JUNK)


@st.composite
def rows(draw: st.DrawFn) -> dict:
    row = draw(SETTINGS)
    kind = draw(st.sampled_from(["prompt", "messages", "both", "neither"]))
    if kind in ("prompt", "both"):
        row["prompt"] = draw(PROMPT)
    if kind in ("messages", "both"):
        row["messages"] = draw(MESSAGES)
    if draw(st.booleans()):
        row["id"] = draw(ID)
    return row


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
LINE = st.one_of(
    rows().map(json.dumps),
    rows().map(json.dumps),
    rows().map(json.dumps),
    JSON_VALUE.map(json.dumps),
    st.text(max_size=20).filter(lambda s: "\n" not in s and "\r" not in s),
    st.just("\udcff"),  # becomes bytes that are not UTF-8
    st.just(""),
)


@pytest.fixture(scope="module")
def shared():
    """One engine for every case: cmd_generate builds an LLM per call, here it gets this one."""
    llm = LLM(max_model_len=512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(turnout.llm, "LLM", lambda config: llm)
        mp.setattr(llm, "shutdown", lambda: None)
        yield llm
    llm.engine.shutdown()


def _run(*argv: str) -> tuple[int, str, str]:
    p = run_cli(*argv, check=False)
    return p.returncode, p.stdout, p.stderr


def check_clean(rc: int, err: str, engine: LLM) -> None:
    assert "Traceback" not in err, err
    assert rc in cli.EXIT_CODES and rc not in (cli.EXIT_INTERNAL, cli.EXIT_INTERRUPTED), (rc, err)
    if rc == cli.EXIT_USAGE:  # nothing ran: one line says why
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    assert not engine.engine.requests and not engine.engine.has_unfinished()


def test_fuzz_jsonl_input(shared: LLM, tmp_path: Path) -> None:
    assert set(VALID) == set(SamplingParams.field_names())  # every field is fuzzed
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"

    @fuzz(100)
    @given(lines=st.lists(LINE, min_size=1, max_size=4), chat=st.booleans())
    def case(lines: list[str], chat: bool) -> None:
        inp.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
        argv = ["generate", "--input", str(inp), "--output", str(out), "--max-tokens", "2"]
        rc, _, err = _run(*argv, *(["--chat"] if chat else []))
        check_clean(rc, err, shared)
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(got) == sum(1 for line in lines if line.strip())  # one row per prompt, blank lines none
        assert all({"id", "text", "token_ids", "finish_reason"} <= set(r) for r in got)
        assert rc == (cli.EXIT_ROWS_FAILED if any("error" in r for r in got) else cli.EXIT_OK)

    case()


FLAG_VALUES = st.one_of(
    st.sampled_from(["0", "1", "2", "-1", "0.5", "inf", "nan", "", "x", "[1]", '{"1": 2}']),
    st.text(max_size=4),
)
GENERATE_FLAGS = [
    "--n", "--best-of", "--max-tokens", "--min-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
    "--sampling-seed", "--seed", "--stop", "--stop-token-ids", "--repetition-penalty", "--presence-penalty",
    "--frequency-penalty", "--logit-bias", "--bad-words", "--logprobs", "--prompt-logprobs", "--block-size",
    "--max-num-seqs", "--dtype",
]  # fmt: skip
SWITCHES = ["--chat", "--json", "--ignore-eos", "--no-skip-special-tokens", "--include-stop-str-in-output"]


def test_fuzz_generate_flags(shared: LLM, tmp_path: Path) -> None:
    @fuzz(60)
    @given(
        flags=st.lists(st.tuples(st.sampled_from(GENERATE_FLAGS), FLAG_VALUES), max_size=4),
        switches=st.lists(st.sampled_from(SWITCHES), max_size=2),
        prompts=st.lists(st.text(max_size=16), max_size=2),
        output=st.booleans(),
    )
    def case(flags: list[tuple[str, str]], switches: list[str], prompts: list[str], output: bool) -> None:
        argv = ["generate", *[f"{f}={v}" for f, v in flags], *switches, *[f"--prompt={p}" for p in prompts]]
        argv += ["--output", str(tmp_path / "o.jsonl")] if output else []
        argv += ["--max-tokens", "2", "--n", "1", "--best-of", "1"]  # the last flag wins: keep cases cheap
        rc, _, err = _run(*argv)
        check_clean(rc, err, shared)

    case()


ENGINE_VALUES = {
    "--tensor-parallel-size": st.integers(-1, 10).map(str),
    "--pipeline-parallel-size": st.integers(-1, 40).map(str),
    "--data-parallel-size": st.integers(0, 3).map(str),
    "--dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16", "float8", ""]),
    "--block-size": st.integers(-1, 64).map(str),
    "--attention-backend": st.sampled_from(["auto", "cpu", "triton", "flashinfer", "nosuch", ""]),
    "--executor": st.sampled_from(["auto", "uniproc", "multiproc", "nosuch"]),
    "--cudagraph-mode": st.sampled_from(["NONE", "FULL", "PIECEWISE", "SOMETIMES"]),
    "--max-logprobs": st.integers(-2, 30).map(str),
    "--max-model-len": st.sampled_from(["0", "64", "100000", "x"]),
    "--cudagraph-capture-sizes": st.sampled_from(["1,2,4", "0", "", "a,b"]),
}


def test_fuzz_explain_flags(tiny_llama: Path) -> None:
    @fuzz(140)
    @given(
        flags=st.lists(
            st.sampled_from(list(ENGINE_VALUES)).flatmap(lambda f: ENGINE_VALUES[f].map(lambda v: (f, v))),
            max_size=4,
        ),
        model=st.sampled_from([None, str(tiny_llama), "/no/such/model", "/no/such/model.gguf"]),
        as_json=st.booleans(),
    )
    def case(flags: list[tuple[str, str]], model: str | None, as_json: bool) -> None:
        argv = ["explain"] + (["--json"] if as_json else []) + (["--model", model] if model else [])
        rc, out, err = _run(*argv, *[f"{f}={v}" for f, v in flags])
        assert "Traceback" not in err, err
        assert rc in (cli.EXIT_OK, cli.EXIT_USAGE), (rc, err)
        if rc == cli.EXIT_USAGE:
            assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
        elif as_json:
            assert set(json.loads(out)["settings"]) == set(cli.EngineConfig.model_fields)

    case()


def test_plain_output_keeps_what_was_asked(shared: LLM) -> None:
    """Plain text cannot show logprobs: asking for them prints JSONL instead of dropping them."""
    rc, out, err = _run("generate", "--prompt", "Hi", "--max-tokens", "2", "--logprobs", "1")
    rec = json.loads(out)
    assert rc == 0 and len(rec["logprobs"]) == len(rec["token_ids"]) == 2 and "Traceback" not in err
    rc, out, _ = _run("generate", "--prompt", "Hi", "--max-tokens", "2", "--n", "2", "--sampling-seed", "1")
    assert rc == 0 and out.count("\n\n") == 2  # two answers, each followed by a blank line
