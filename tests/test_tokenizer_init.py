"""Prompts of token ids need no tokenizer (vLLM's skip_tokenizer_init); a text prompt without a usable one
is a one-line RequestError that names the folder and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from turnout import LLM, SamplingParams
from turnout.engine import llm_engine
from turnout.errors import ConfigError, RequestError

KW = dict(cpu_kv_cache_bytes=1 << 22, block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
PROMPT = [1, 5, 9, 42]


def _without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of a tiny model folder with its tokenizer files removed: config and weights only."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def bare(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(folder, LLM): a llama folder transformers cannot load a tokenizer from, and a qwen3 one where it
    gives its empty fallback (special tokens only, text encodes to nothing)."""
    src = request.getfixturevalue(f"tiny_{request.param}")
    path = _without_tokenizer(src, tmp_path_factory.mktemp("bare") / request.param)
    llm = LLM(str(path), **KW)
    yield path, llm
    llm.shutdown()


def test_token_ids_run_without_tokenizer_files(bare) -> None:
    path, llm = bare
    assert llm.get_tokenizer() is None
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT and len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].text == ""
    assert all(lp.decoded_token is None for pos in out.outputs[0].logprobs for lp in pos.values())


@pytest.mark.parametrize("prompt", ["w1 w2 w3", {"prompt": "w1 w2"}])
def test_text_without_tokenizer_is_one_line_naming_the_folder(bare, prompt) -> None:
    path, llm = bare
    with pytest.raises(RequestError) as e:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert msg.startswith("prompt 0: text prompts need a tokenizer") and str(path) in msg
    assert "tokenizer files" in msg and "tokenizer=" in msg


def test_chat_and_stop_strings_without_tokenizer(bare) -> None:
    path, llm = bare
    with pytest.raises(RequestError, match="chat conversations need a tokenizer") as e:
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert str(path) in str(e.value)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, stop=["w1"]), use_tqdm=False)


def test_skip_tokenizer_init_loads_none(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder has a tokenizer, but none is loaded; the token ids match a run with one."""

    def refuse(*args, **kwargs):
        raise AssertionError("skip_tokenizer_init loaded a tokenizer")

    with_tokenizer = LLM(str(tiny_llama), **KW)
    want = with_tokenizer.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    with_tokenizer.shutdown()
    monkeypatch.setattr(llm_engine.AutoTokenizer, "from_pretrained", refuse)
    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, **KW)
    try:
        got = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
        assert llm.tokenizer is None and got.token_ids == want.token_ids and got.text == ""
        with pytest.raises(ValueError, match=r"^prompt 0: text prompts need a tokenizer, but skip_tok"):
            llm.generate("w1 w2", GREEDY, use_tqdm=False)
        with pytest.raises(RequestError, match="skip_tokenizer_init"):
            next(llm.stream("w1 w2", GREEDY))
    finally:
        llm.shutdown()


def test_a_named_tokenizer_that_does_not_load_fails_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_llama), tokenizer=str(empty), **KW)
    assert str(empty) in str(e.value) and "\n" not in str(e.value)


# ---- the data-parallel engine, turnout serve, tune and bench on a folder without tokenizer files ----
@pytest.fixture(scope="module")
def bare_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _without_tokenizer(tiny_llama, tmp_path_factory.mktemp("bare_llama") / "llama")


def _jsonl(path: Path, *prompts: object) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3}) + "\n" for p in prompts))
    return path


def test_data_parallel_names_the_folder_as_one_engine_does(bare_llama: Path) -> None:
    llm = LLM(str(bare_llama), data_parallel_size=2, **KW)
    try:
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
        with pytest.raises(
            RequestError, match="^conversation 0: chat conversations need a tokenizer, but model folder"
        ) as e:
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
        assert str(bare_llama) in str(e.value) and "tokenizer files" in str(e.value)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def bare_server(bare_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """`turnout serve` on bare_llama, its engine core in a process of its own; and the reference tokens."""
    pytest.importorskip("openai")
    from test_server import TINY, Server

    server = Server(tmp_path_factory.mktemp("bare_server"), str(bare_llama), *TINY, wait=False)
    try:
        llm = LLM(str(bare_llama), **KW)
        ref = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
        server.wait_ready()
        yield server, ref
    finally:
        server.stop()


def _bad_request(call) -> dict:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400 and set(e.value.body) == {"message", "type", "param", "code"}
    assert "\n" not in e.value.body["message"]
    return e.value.body


def test_server_without_tokenizer_files_serves_token_ids(bare_server, bare_llama: Path) -> None:
    server, ref = bare_server
    client, model = server.client(), str(bare_llama)  # served by the name it was given
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    c = out.choices[0]
    assert c.text == "" and out.usage.completion_tokens == 4 and out.usage.prompt_tokens == len(PROMPT)
    assert c.logprobs.tokens == [f"token_id:{t}" for t in ref]  # greedy: LLM.generate's tokens
    stream = client.completions.create(
        model=model, prompt=[PROMPT, PROMPT[:2]], max_tokens=3, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [ch.choices[0] for ch in stream]
    assert sorted(c.index for c in chunks if c.finish_reason == "length") == [0, 1]
    assert "".join(c.text for c in chunks) == ""


def test_server_without_tokenizer_files_answers_text_with_a_400(bare_server, bare_llama: Path) -> None:
    server, _ = bare_server
    client, model = server.client(), str(bare_llama)
    body = _bad_request(lambda: client.completions.create(model=model, prompt="w1 w2", max_tokens=2))
    assert body["message"].startswith("text prompts need a tokenizer, but model folder")
    assert str(bare_llama) in body["message"] and "tokenizer files" in body["message"]
    assert "tokenizer=" in body["message"] and body["param"] == "prompt"
    body = _bad_request(
        lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    )
    assert body["message"].startswith("chat conversations need a tokenizer") and body["param"] == "messages"
    assert str(bare_llama) in body["message"]
    body = _bad_request(lambda: client.completions.create(model=model, prompt=PROMPT, stop=["w1"]))
    assert body["message"].startswith("stop strings need a tokenizer") and body["param"] == "stop"
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


def test_serve_skip_tokenizer_init_loads_none(tiny_llama: Path, tmp_path: Path) -> None:
    """The folder has a tokenizer, but --skip-tokenizer-init loads none, with the core in a thread."""
    pytest.importorskip("openai")
    from test_server import TINY, Server

    env = {"TURNOUT_ENABLE_MULTIPROCESSING": "0"}
    server = Server(tmp_path, str(tiny_llama), *TINY, "--skip-tokenizer-init", env=env)
    try:
        client, model = server.client(), str(tiny_llama)
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=0)
        assert out.choices[0].text == "" and out.usage.completion_tokens == 2
        assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
        body = _bad_request(lambda: client.completions.create(model=model, prompt="w1 w2", max_tokens=2))
        assert body["message"] == (
            "text prompts need a tokenizer, but skip_tokenizer_init is set; pass token ids, or unset "
            "skip_tokenizer_init"
        )
    finally:
        server.stop()
    assert "engine core in a thread" in server.log.read_text()


def test_tune_runs_token_ids_without_tokenizer_files(bare_llama: Path, tmp_path: Path, capsys) -> None:
    from turnout.cli import main
    from turnout.config import EngineConfig
    from turnout.tuning import tune

    ids = _jsonl(tmp_path / "ids.jsonl", [5, 6, 7, 8], [9, 10, 11])
    config = EngineConfig(model=str(bare_llama), dtype="float32")
    record = tune(
        config, str(ids), budget=60, progress=False, axes=("max_num_batched_tokens",), directory=tmp_path
    )
    assert record.candidates and all(len(c.runs) >= 2 for c in record.candidates)
    text = _jsonl(tmp_path / "text.jsonl", [5, 6, 7], "w1 w2")
    assert main(["tune", str(bare_llama), "--workload", str(text)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {text}:2: text prompts need a tokenizer, but model folder {bare_llama}")
    assert "\n" not in err


def test_bench_runs_token_ids_without_tokenizer_files(bare_llama: Path, tmp_path: Path, capsys) -> None:
    from turnout.cli import main

    ids, out = _jsonl(tmp_path / "ids.jsonl", [5, 6, 7, 8], [9, 10, 11]), tmp_path / "r.json"
    argv = ["bench", "throughput", "--model", str(bare_llama), "--max-model-len", "256"]
    assert main([*argv, "--input", str(ids), "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [r["output_tokens"] for r in recs] == [2 * 3, 2 * 3]
    text = _jsonl(tmp_path / "text.jsonl", "w1 w2")
    assert main([*argv, "--input", str(text), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {text}:1: text prompts need a tokenizer, but model folder {bare_llama}")
