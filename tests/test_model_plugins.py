"""The bundled Mistral, Mixtral, Gemma 2 and Gemma 3 plugins generate like HF transformers (float32, each
prompt alone, eager attention): greedy tokens exactly, over prompts longer than every sliding window, batched
and one at a time, with and without chunked prefill, on prefix-cache hits, under tensor parallelism
(Mixtral's experts split over the ranks by expert parallelism) and, for Gemma 3, with the Triton backend in
Triton's interpreter. Gemma 3 is checked from both spellings of its config.json: transformers 5's layer_types
and rope_parameters nested by layer type, and the older sliding_window_pattern, rope_theta, rope_scaling and
rope_local_base_freq. A checkpoint missing a part of a fused parameter, holding a tensor no parameter takes,
or one of the wrong shape is refused naming the checkpoint tensor."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from turnout_gemma3 import attention_features
from turnout_gemma3.model import Gemma3ForCausalLM

from turnout import LLM, SamplingParams, TurnoutError, hookimpl
from turnout.models import ModelArchitecture

from tiny_models import (
    TOKENIZER_VOCAB,
    assert_matches_reference,
    assert_parallel_matches_reference,
    checkpoints,
    hf_greedy,
    save_random_model,
    write_tokenizer,
)

WINDOW = 8
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW = {"dtype": "float32", "cpu_kv_cache_bytes": 1 << 22, "block_size": 4}
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
    tie_word_embeddings=False,
)  # fmt: skip
# Gemma 3's 3 layers: local, local, global; each layer type its own rope base, the global one scaled
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
CONFIGS = {  # case -> (HF config class, its own keys); Gemma 2's 3 layers: sliding, full, sliding
    "mistral": ("MistralConfig", dict(intermediate_size=128, num_hidden_layers=2)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", dict(intermediate_size=128, num_hidden_layers=3, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=128, num_hidden_layers=3, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention"] * 2 + ["full_attention"],
                                        rope_parameters=GEMMA3_ROPE)),
}  # fmt: skip
CONFIGS["gemma3-older-keys"] = CONFIGS["gemma3"]  # written, then config.json respelled
ARCH = {"mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM"}  # fmt: skip


def _older_keys(cfg: dict) -> dict:
    """The same Gemma 3 config as transformers 4 spelled it: no layer_types, rope not nested."""
    rope = cfg.pop("rope_parameters")
    del cfg["layer_types"], cfg["_sliding_window_pattern"]
    full, local = dict(rope["full_attention"]), rope["sliding_attention"]
    older = {
        "rope_theta": full.pop("rope_theta"),
        "rope_scaling": full,
        "rope_local_base_freq": local["rope_theta"],
    }
    return {**cfg, "sliding_window_pattern": 3, **older}


_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, TOKENIZER_VOCAB) for _ in range(_rng.randrange(10, 40))] for _ in range(8)]
assert min(map(len, PROMPTS)) > WINDOW


def _write(path: Path, case: str) -> Path:
    """A tiny random checkpoint, weights (and Gemma's norms) widened so that logits are far from ties."""
    import transformers

    cls, own = CONFIGS[case]
    save_random_model(path, getattr(transformers, cls)(**COMMON, **own), wide_norms=case.startswith("gemma"))
    if case.endswith("older-keys"):
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(_older_keys(cfg), indent=2))
    write_tokenizer(path)
    return path


def _hf_greedy(path: Path) -> list[list[int]]:
    return hf_greedy(path, PROMPTS, MAX_NEW, attn_implementation="eager")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(case) -> (its tiny checkpoint, HF's greedy tokens for PROMPTS), each written once."""
    return checkpoints(tmp_path_factory.mktemp, _write, _hf_greedy)


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The triton attention backend, off CUDA in Triton's interpreter (conftest imports triton under
    TRITON_INTERPRET=1; the backend reads the variable when it is built)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(importlib.import_module("triton.language").cdiv, InterpretedFunction):
            pytest.skip("triton was first imported without TRITON_INTERPRET=1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("case", list(ARCH))
def test_greedy_matches_hf(checkpoint, case: str) -> None:
    """Batched, then each prompt again alone (every one a prefix hit), then chunked by a 16-token budget."""
    path, ref = checkpoint(case)
    llm = LLM(str(path), **KW)
    assert (llm.selection.model.chosen.name, llm.selection.model.chosen.plugin) == (ARCH[case], case)
    assert_matches_reference(llm, path, ref, PROMPTS, GREEDY, **KW)


def test_gemma3_from_the_older_config_keys_matches_hf(checkpoint) -> None:
    """The same checkpoint with config.json in transformers 4's spelling (sliding_window_pattern, rope_theta,
    rope_scaling, rope_local_base_freq): HF reads the same model from it, and so does turnout."""
    path, ref = checkpoint("gemma3-older-keys")
    cfg = json.loads((path / "config.json").read_text())
    assert "layer_types" not in cfg and "rope_parameters" not in cfg and ref == checkpoint("gemma3")[1]
    assert _tokens(LLM(str(path), max_num_batched_tokens=16, **KW), PROMPTS) == ref


@pytest.mark.parametrize("case,tables", [("mistral", 1), ("gemma3", 2)])
def test_layers_of_one_rope_share_its_tables(checkpoint, case: str, tables: int) -> None:
    """One cos/sin table per rope, not per layer: at Mistral-7B's 32 layers and 40,960 positions, 21 MB
    each."""
    model = LLM(str(checkpoint(case)[0]), **KW).engine.executor.worker.runner.model
    assert len({id(layer.self_attn.rotary) for layer in model.model.layers}) == tables


PARALLEL = [  # the parallelism each model adds to the shared decoder's (test_multiproc runs its TP 2)
    pytest.param("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True), id="mixtral-tp2-ep"),
    pytest.param("gemma2", dict(tensor_parallel_size=2), id="gemma2-tp2"),
    pytest.param("gemma2", dict(pipeline_parallel_size=2), id="gemma2-pp2"),
    pytest.param("gemma3", dict(tensor_parallel_size=2), id="gemma3-tp2"),
    pytest.param("gemma3", dict(pipeline_parallel_size=2), id="gemma3-pp2"),
]


@pytest.mark.parametrize("case,parallel", PARALLEL)
@pytest.mark.slow
def test_parallel_matches_hf(checkpoint, case: str, parallel: dict) -> None:
    """Two ranks over gloo, chunked prefill on four prompts, then two of them again as prefix hits."""
    assert_parallel_matches_reference(*checkpoint(case), PROMPTS, GREEDY, parallel, **KW)


def test_gemma3_on_triton_in_the_interpreter_matches_hf(checkpoint, triton_interpreter) -> None:
    """Triton's kernels (in the interpreter off CUDA) with Gemma 3's window: two prompts past it, chunked by
    a 16-token budget, then one again as a prefix hit; HF's first three tokens (the interpreter is slow)."""
    path, ref = checkpoint("gemma3")
    llm = LLM(str(path), max_num_batched_tokens=16, attention_backend="triton", **KW)
    assert llm.selection.attention.chosen.name == "triton"
    three = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    two = [PROMPTS[0], PROMPTS[3]]  # 20 and 28 tokens
    outs = llm.generate(two + [PROMPTS[0]], three, use_tqdm=False)
    assert min(map(len, two)) > 16 and [o.token_ids for o in outs] == [ref[0][:3], ref[3][:3], ref[0][:3]]
    assert outs[2].num_cached_tokens >= len(PROMPTS[0]) - 4, outs[2].num_cached_tokens


WRONG = [  # case, config.json key, a value the class does not implement, the line that says so
    ("gemma2", "hidden_activation", "relu",
     "sets hidden_activation = 'relu', which Gemma2ForCausalLM does not"),
    ("gemma2", "rope_parameters", {"rope_type": "proportional"},
     "config.json's rope_parameters: .*'proportional'"),
    ("gemma3", "rope_parameters", {"full_attention": {"rope_type": "proportional"}},
     "config.json's rope for full_attention: rope scaling 'proportional' is not supported"),
    ("gemma3", "rope_parameters", {"rope_type": "linear", "factor": 8.0},
     "config.json's rope for .*: rope_parameters is one flat dict, which HF's Gemma3TextConfig ignores"),
    ("gemma3", "use_bidirectional_attention", True,
     "sets use_bidirectional_attention = True, which changes the model's math and Gemma3ForCausalLM"),
    ("gemma3", "layer_types", ["sliding_attention", "chunked_attention", "full_attention"],
     "config.json's layer_types give kinds chunked_attention for 3 layers"),
]  # fmt: skip


@pytest.mark.parametrize("case,key,value,why", WRONG, ids=[f"{w[0]}-{w[1]}" for w in WRONG])
def test_what_a_plugin_does_not_implement_is_refused(
    checkpoint, tmp_path: Path, case, key, value, why
) -> None:
    """One line naming the config key, before any weight loads."""
    path = Path(shutil.copytree(checkpoint(case)[0], tmp_path / "ckpt"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(TurnoutError, match=why):
        LLM(str(path), **KW)


def _missing(tensors: dict, name: str) -> str:
    del tensors[name]
    return f"the checkpoint lacks {re.escape(name)}, which fills "


def _surplus(tensors: dict, name: str) -> str:
    extra = f"{name.rsplit('.', 2)[0]}.extra_proj.weight"
    tensors[extra] = tensors[name].clone()
    return f"the checkpoint's {re.escape(extra)} is used by no parameter of "


def _wrong_shape(tensors: dict, name: str) -> str:
    tensors[name] = tensors[name][:-1].clone()
    return f"the checkpoint's {re.escape(name)} has shape "


FUSED_PART = {  # a checkpoint tensor that fills one part of a fused parameter
    "mistral": "model.layers.1.mlp.up_proj.weight",
    "mixtral": "model.layers.1.block_sparse_moe.experts.2.w3.weight",
    "gemma2": "model.layers.0.self_attn.k_proj.weight",
    "gemma3": "model.layers.2.self_attn.k_proj.weight",
}
BROKEN = [
    pytest.param(c, f, id=f"{c}-{f.__name__[1:]}")
    for c in FUSED_PART
    for f in (_missing, _surplus, _wrong_shape)
]


@pytest.mark.parametrize("case,breaks", BROKEN)
def test_a_checkpoint_off_by_one_tensor_is_refused_naming_it(
    checkpoint, tmp_path: Path, case, breaks
) -> None:
    """Without one part of a fused parameter, with a tensor no parameter takes, or with a part one row short:
    one line naming the checkpoint tensor, and no start."""
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(checkpoint(case)[0], tmp_path / "ckpt"))
    tensors = load_file(path / "model.safetensors")
    why = breaks(tensors, FUSED_PART[case])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TurnoutError, match=why) as e:
        LLM(str(path), **KW)
    assert "\n" not in str(e.value)


TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=TOKENIZER_VOCAB)  # fmt: skip
BENCH_SHAPES = {  # `turnout bench --random-model` shape -> its architecture's layers at a tiny scale
    "mistral-7b": dict(num_hidden_layers=2),
    "gemma-3-12b": dict(num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=16),  # 5 local, 1 global
}


@pytest.mark.parametrize("shape", list(BENCH_SHAPES))
def test_bench_random_shapes_write_what_hf_and_turnout_load_alike(tmp_path, monkeypatch, shape: str) -> None:
    """The random checkpoint `turnout bench --random-model` writes for the shape, its dimensions cut down
    (every other key its own): HF transformers reads the architecture from config.json, and turnout's greedy
    tokens are HF's, over prompts past Gemma 3's window. Its FP8 variants are listed beside it."""
    from turnout.bench import random_models

    from tiny_models import hf_greedy

    arch, kw = random_models.SHAPES[shape]
    monkeypatch.setitem(random_models.SHAPES, "tiny", (arch, {**kw, **TINY, **BENCH_SHAPES[shape]}))
    path = random_models.make_random_model(tmp_path / "tiny", "tiny")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [{"mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]]
    prompts = [list(range(5, 17)), list(range(40, 50))]
    llm = LLM(str(path), dtype="float32", max_model_len=64, cpu_kv_cache_bytes=1 << 22)
    assert llm.selection.model.chosen.plugin == arch
    assert _tokens(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)
    assert {f"{shape}-{v}" for v in random_models.FP8_VARIANTS} <= set(random_models.RANDOM_MODELS)


# docs/writing-a-plugin.md, "Testing a model plugin", shows these two classes as they are here
class Gemma3Recording(Gemma3ForCausalLM):
    """Gemma 3 that keeps the positions of every forward: one list per step the engine ran."""

    steps: list[list[int]] = []

    def forward(self, input_ids, positions, intermediate=None):
        Gemma3Recording.steps.append(positions.tolist())
        return super().forward(input_ids, positions, intermediate)


class Recording:
    """A plugin that offers Gemma3Recording above the bundled class (priority 1 > 0)."""

    @hookimpl
    def turnout_model_architectures(self):
        target = f"{__name__}:Gemma3Recording"
        return [
            ModelArchitecture("Gemma3ForCausalLM", target, priority=1, attention_features=attention_features)
        ]


def test_chunked_prefill_and_prefix_hits_seen_as_the_guide_shows(checkpoint, register_plugin) -> None:
    """A 36-token prompt under a 16-token budget prefills at positions 0, 16 and 32, then decodes one position
    a step; run again, 32 of its tokens (8 whole blocks, the last token left to compute) are prefix hits."""
    register_plugin(Recording(), "recording")
    path, ref = checkpoint("gemma3")
    llm = LLM(str(path), max_num_batched_tokens=16, **KW)
    assert llm.selection.model.chosen.plugin == "recording"
    Gemma3Recording.steps.clear()  # on CUDA, the warm-up's steps
    first = llm.generate([PROMPTS[6]], GREEDY, use_tqdm=False)[0]
    assert [(s[0], len(s)) for s in Gemma3Recording.steps] == [(0, 16), (16, 16), (32, 4)] + [
        (36 + i, 1) for i in range(MAX_NEW - 1)
    ]
    again = llm.generate([PROMPTS[6]], GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert first.token_ids == again.token_ids == ref[6]


def test_the_guide_shows_what_the_tests_run() -> None:
    """The recording model above, the example Gemma 2's whole entry module, and the pipeline-parallel
    refusal whose "(2)" the guide explains, as turnout words it."""
    guide = (Path(__file__).parents[1] / "docs/writing-a-plugin.md").read_text()
    for shown in (Gemma3Recording, Recording):
        assert inspect.getsource(shown) in guide, shown.__name__
    example = Path(__file__).parents[1] / "examples/turnout-example-gemma2/turnout_example_gemma2/__init__.py"
    assert example.read_text() in guide
    refusal = ModelArchitecture("GPTNeoXForCausalLM", "m:C", pipeline_parallel=False).problems(1, 2, False)[0]
    assert f"`model GPTNeoXForCausalLM (example_model): {refusal}`" in " ".join(guide.split())
