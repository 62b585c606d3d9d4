"""Prompts of token ids need no tokenizer (vLLM's skip_tokenizer_init); a text prompt without a usable one
is a one-line RequestError that names the folder and the fix."""

from __future__ import annotations

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
