"""examples/turnout-example-gemma2, a model plugin whose attention layers have per-layer features (a
sliding window on every other layer, a logit soft-cap on all, query_pre_attn_scalar's scale), generates
like HF transformers' Gemma2ForCausalLM in float32: greedy tokens exactly and their logprobs (which the
final soft-cap shapes), over prompts longer than the window, chunked prefill and prefix-cache hits, on every
backend that declares those features; the one-line refusals of the others."""

from __future__ import annotations

import importlib
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams, TurnoutError, hookimpl
from turnout.models import ModelArchitecture

from tiny_models import write_tokenizer

EXAMPLES = Path(__file__).parents[1] / "examples"
WINDOW = 8
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _tiny_gemma2(path: Path) -> Path:
    """4 layers (sliding, full, sliding, full), a window of 8, caps that bite, and a scale of 24 ** -0.5
    (head_dim 16 would give 16 ** -0.5); weights and norms widened so that logits are far from ties."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=3.0, final_logit_softcapping=5.0, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def _hf_greedy(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt alone through HF's eager forward: the argmax tokens and their logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    tokens, logprobs = [], []
    for p in prompts:
        ids, lps = list(p), []
        with torch.no_grad():
            for _ in range(MAX_NEW):
                logp = model.eval()(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                ids.append(int(logp.argmax()))
                lps.append(float(logp[ids[-1]]))
        tokens.append(ids[len(p) :])
        logprobs.append(lps)
    return tokens, logprobs


def _prompts(seed: int, n: int, lo: int, hi: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


# 3 to 40 tokens, most past the window; then a 21-token prefix shared by all, cached after the first
PROMPTS = _prompts(1, 4, 3, 40) + _prompts(2, 3, 2, 9, prefix=21)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[float]]]:
    path = _tiny_gemma2(tmp_path_factory.mktemp("tiny_gemma2"))
    return path, *_hf_greedy(path, PROMPTS)


@pytest.fixture
def example_gemma2(monkeypatch, register_plugin):
    """examples/turnout-example-gemma2 (and the example backend) registered in-process, as their entry
    points would register them."""
    for name in ("turnout-example-gemma2", "turnout-example-backend"):
        monkeypatch.syspath_prepend(str(EXAMPLES / name))
    for module in ("turnout_example_gemma2", "turnout_example_backend"):
        register_plugin(importlib.import_module(module), module.removeprefix("turnout_"))


def _generate(path: Path, backend: str) -> tuple[LLM, list[list[int]], list[list[float]]]:
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_bytes=1 << 22, max_num_batched_tokens=16,
              block_size=4, attention_backend=backend)  # fmt: skip
    first = llm.generate(PROMPTS[:5], GREEDY, use_tqdm=False)  # chunked: prompts past 16 tokens
    rest = llm.generate(PROMPTS[5:], GREEDY, use_tqdm=False)  # the shared prefix is cached by PROMPTS[4]
    assert all(o.num_cached_tokens >= 20 for o in rest), [o.num_cached_tokens for o in rest]
    outs = first + rest
    lps = [[lp[t].logprob for t, lp in zip(o.token_ids, o.outputs[0].logprobs)] for o in outs]
    return llm, [o.token_ids for o in outs], lps


@pytest.mark.parametrize("backend", ["cpu", "naive", pytest.param("triton", marks=pytest.mark.slow)])
def test_gemma2_generates_like_hf(gemma2, example_gemma2, backend: str, monkeypatch) -> None:
    """On the CPU the triton backend runs its kernels in Triton's interpreter."""
    path, hf_tokens, hf_logprobs = gemma2
    if backend == "triton" and not torch.cuda.is_available():
        pytest.importorskip("triton")
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(importlib.import_module("triton.language").cdiv, InterpretedFunction):
            pytest.skip("triton was first imported without TRITON_INTERPRET=1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the backend is built
    llm, tokens, logprobs = _generate(path, backend)
    sel = llm.engine.selection
    assert sel.model.chosen.plugin == "example_gemma2" and sel.attention.chosen.name == backend
    assert tokens == hf_tokens
    flat = lambda rows: [x for row in rows for x in row]
    assert flat(logprobs) == pytest.approx(flat(hf_logprobs), abs=1e-4)


def test_gemma2_refuses_backends_without_its_features(gemma2, example_gemma2) -> None:
    """flashinfer and flash_attn declare no per-layer features: named for Gemma 2 they are refused with
    the reason (besides the CPU's own)."""
    with pytest.raises(TurnoutError, match=r"per-layer logits_soft_cap, sliding_window unsupported"):
        LLM(str(gemma2[0]), attention_backend="flashinfer")


class _Undeclared:
    """Gemma 2's class declared without its attention_features, and a backend that serves none."""

    @hookimpl
    def turnout_model_architectures(self):
        target = "turnout_example_gemma2.model:Gemma2ForCausalLM"
        return [ModelArchitecture("Gemma2ForCausalLM", target, 50, pipeline_parallel=False)]

    @hookimpl
    def turnout_attention_backends(self, platform):
        from turnout_cpu.backend import CPUAttentionBackend

        class Plain(CPUAttentionBackend):
            name = "plain"
            attention_features = frozenset()  # the CPU impl's, serving none

        return [Plain()]


def test_layers_using_an_undeclared_feature_stop_start_up(gemma2, example_gemma2, register_plugin) -> None:
    """Selection goes by the declaration; the runner checks the layers as built, so a declaration that
    falls short is one clear error, not wrong tokens."""
    register_plugin(_Undeclared(), "undeclared")
    why = "attention layers use per-layer logits_soft_cap, sliding_window, which attention backend plain"
    with pytest.raises(TurnoutError, match=f"Gemma2ForCausalLM's {why} does not serve"):
        LLM(str(gemma2[0]), cpu_kv_cache_bytes=1 << 22, attention_backend="plain")


def test_the_guide_shows_the_declaration_verbatim() -> None:
    source = (EXAMPLES / "turnout-example-gemma2/turnout_example_gemma2/__init__.py").read_text()
    start = source.index("def attention_features")
    declaration = source[start : source.index("return used\n", start) + len("return used\n")]
    assert declaration in (EXAMPLES.parent / "docs/writing-a-plugin.md").read_text()
