"""The embedded SmolLM2-135M-Instruct through the engine against HF transformers loading the same GGUF file,
both in float32 from its dequantized weights, greedy, on chat prompts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.loader.default_model import default_gguf_path

from hf_gguf import hf_llama_from_gguf

CHATS = [  # no other test asks these
    "Translate 'good morning' into French.",
    "Give me two tips for sleeping better.",
    "What does a signal box on a railway do?",
    "Suggest a name for a grey cat.",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_model_len=512, dtype="float32")  # no model: the embedded default
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_float32_greedy_matches_hf_on_the_gguf(llm):
    """float32 computes with the GGUF's float32-dequantized weights, bit for bit transformers' own: the
    same greedy tokens on chat prompts whose top two tokens can lie a few hundredths of a nat apart."""
    hf = hf_llama_from_gguf(default_gguf_path())
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    ids = [llm.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    refs = []
    for i in ids:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([i]), max_new_tokens=MAX_NEW, do_sample=False)
        refs.append(gen[0, len(i) :].tolist())
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs


@pytest.mark.slow
def test_stop_strings_and_seeded_sampling(llm):
    prompt = llm.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    )
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "5" in full.text
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=["5"]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and "5" not in cut.text and full.text.startswith(cut.text)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, n=2)
    a = llm.generate([prompt, prompt], sp, use_tqdm=False)
    b = llm.generate(prompt, sp, use_tqdm=False)
    assert (
        [c.token_ids for c in a[0].outputs]
        == [c.token_ids for c in a[1].outputs]
        == [c.token_ids for c in b[0].outputs]
    )
    assert a[0].outputs[0].token_ids != a[0].outputs[1].token_ids  # seeds seed and seed+1


@pytest.mark.slow
def test_bad_request_fails_alone(llm):
    sp = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate(["Hello!", "Name a color."], sp, use_tqdm=False)
    for bad, why in (("", "prompt 1: empty prompt"), ([1] * 600, "prompt 1: prompt is 600 tokens")):
        with pytest.raises(ValueError, match=why):  # raised before anything runs, as in vLLM
            llm.generate(["Hello!", bad, "Name a color."], sp, use_tqdm=False)
        assert not llm.engine.requests and not llm.engine.has_unfinished()
    alone = llm.generate(["Hello!", "Name a color."], sp, use_tqdm=False)
    assert [o.token_ids for o in alone] == [o.token_ids for o in before]
    lp = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(lp.logprobs) == 3 and all(tok in d for tok, d in zip(lp.token_ids, lp.logprobs))
    tops = [sorted(d.values(), key=lambda x: x.rank)[:2] for d in lp.logprobs]
    assert all([a.rank, b.rank] == [1, 2] and a.logprob >= b.logprob for a, b in tops)


@pytest.mark.slow
def test_text_is_the_same_streamed_batched_and_decoded(llm):
    """Batched requests get their text once at the end; LLM.stream gets it token by token (incremental
    detokenizer): both must equal the tokenizer's decode of the same tokens."""
    prompt = llm.apply_chat_template([{"role": "user", "content": "Write a haiku about trains."}])
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    streamed = "".join(llm.stream(prompt, sp))
    assert out.text == streamed == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert len(out.text) > 20


def test_token_slice_is_a_slice_of_the_history():
    from turnout.engine.request import Request

    req = Request("r", list(range(10, 17)), SamplingParams(), output_token_ids=list(range(50, 55)))
    history = req.prompt_token_ids + req.output_token_ids
    for start in range(req.num_tokens + 1):
        for n in range(req.num_tokens - start + 2):
            assert req.token_slice(start, n) == history[start : start + n]


def test_detokenizer_holds_back_a_split_char_until_the_last_step():
    """The train emoji spans three byte-level tokens: mid-stream its first bytes are held back; a request
    that ends inside it (max_tokens) still gets decode()'s text, U+FFFD included, not nothing."""
    from transformers import AutoTokenizer

    from turnout.engine.detokenizer import Detokenizer
    from turnout.loader.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    ids = tok.encode("Trains \U0001f682 run")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    streamed = Detokenizer(tok)
    for k in range(1, cut + 1):
        streamed.step(ids[:k])
    assert streamed.text == tok.decode(ids[: cut - 1]) and not streamed.text.endswith("\ufffd")
    for final in (False, True):  # lazily: one step at the end, as for a batched request
        d = Detokenizer(tok)
        d.step(ids[:cut], final=final)
        assert d.text == ("Trains \ufffd" if final else "")
    whole = Detokenizer(tok)
    for k in range(1, len(ids) + 1):
        whole.step(ids[:k], final=k == len(ids))
    assert whole.text == tok.decode(ids) == "Trains \U0001f682 run"


def test_runtime_install_leaves_triton_and_ray_to_extras():
    """scripts/install.sh: CPU torch from PyTorch's CPU index (the main index, with a message, where that is
    unreachable); Triton and Ray only with --test (make test), from the test extra; turnout[ray] for users."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {re.split(r"[<>=\[; ]", r, maxsplit=1)[0] for r in reqs}
    assert not names(project["dependencies"]) & {"triton", "ray"}
    assert {"triton", "ray"} <= names(project["optional-dependencies"]["test"])
    assert names(project["optional-dependencies"]["ray"]) == {"ray"}
    script = (root / "scripts/install.sh").read_text()
    assert '--index-url "$CPU_INDEX"' in script and "CPU_INDEX=https://download.pytorch.org/whl/cpu" in script
    assert "is unreachable; installing $spec from the main index" in script
    assert not re.search(r"^\$PIP install .*\b(ray|triton)\b", script, re.M)
    assert "EXTRAS=bench,test" in script and '$PIP install -q -e ".[$EXTRAS]"' in script
