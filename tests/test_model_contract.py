"""The model and backend contracts as a third party meets them: an out-of-tree model plugin generates like HF
transformers, the runner finds attention layers by walking modules, and the chosen backend gets its
AttentionSpec once, before the KV cache is sized."""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from turnout import LLM, SamplingParams, TurnoutError, hookimpl
from turnout.attention import AttentionBackend, AttentionImpl, AttentionLayerSpec, AttentionSpec
from turnout.models import CausalLM, ModelArchitecture

from tiny_models import hf_greedy, make_tiny_model, write_tokenizer

EXAMPLE_MODEL = Path(__file__).parents[1] / "examples/turnout-example-model"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _tiny_neox(path: Path, parallel_residual: bool, rotary_pct: float) -> Path:
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    config = GPTNeoXConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rotary_pct=rotary_pct, use_parallel_residual=parallel_residual,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # widen the tiny random init so that logits are far from ties
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1 if p.shape == (64,) else 0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


@pytest.fixture
def example_model(monkeypatch, register_plugin):
    """examples/turnout-example-model registered in-process, as its entry point would register it."""
    monkeypatch.syspath_prepend(str(EXAMPLE_MODEL))
    module = importlib.import_module("turnout_example_model")
    register_plugin(module, "example_model")
    return module


@pytest.mark.parametrize("parallel_residual,rotary_pct", [(True, 0.5), (False, 1.0)])
def test_third_party_model_plugin_generates_like_hf(
    tmp_path, example_model, parallel_residual: bool, rotary_pct: float
) -> None:
    """GPT-NeoX is not built on the bundled decoder: no model.model.layers, LayerNorms, a parallel residual,
    partial rotary, a head-interleaved fused qkv. Greedy tokens match HF's over chunked prefill and decode."""
    path = _tiny_neox(tmp_path, parallel_residual, rotary_pct)
    prompts = _prompts(1, 5, 2, 40)
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_bytes=1 << 22, max_num_batched_tokens=32, block_size=8)
    assert llm.engine.selection.model.chosen.plugin == "example_model"
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)


class _Recording:
    """A CPU backend that logs what the runner has it make and do, in order."""

    def __init__(self) -> None:
        from turnout_cpu.backend import CPUAttentionBackend, CPUMetadataBuilder

        events: list[tuple] = []
        self.events = events

        class Builder(CPUMetadataBuilder):
            def build(self, meta):
                events.append(("build", self.group))
                return super().build(meta)

        class Recording(CPUAttentionBackend):
            name = "recording"
            builder_cls = Builder

            def make_impl(self, spec: AttentionSpec, layer: AttentionLayerSpec):
                events.append(("make_impl", spec, layer))
                return super().make_impl(spec, layer)

            def make_builder(self, spec: AttentionSpec, group: int = 0):
                events.append(("make_builder", spec, group))
                return super().make_builder(spec, group)

            def kv_cache_shape(self, *args: int) -> tuple:
                events.append(("kv_cache_shape",))
                return super().kv_cache_shape(*args)

        self.cls = Recording

    @hookimpl
    def turnout_attention_backends(self, platform):
        return [self.cls()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the recording backend is the CPU one")
def test_a_model_declares_the_parallelism_it_supports(tmp_path, example_model, tiny_llama, capsys) -> None:
    """The example model builds every layer on one stage: pipeline parallelism is refused with one line,
    the same from LLM and from `turnout explain`, before any worker starts. enable_expert_parallel on a dense
    model is told it has no experts."""
    from turnout.cli import main

    path = str(_tiny_neox(tmp_path, True, 1.0))
    capsys.readouterr()
    with pytest.raises(TurnoutError) as e:
        LLM(path, pipeline_parallel_size=2)
    assert str(e.value) == (
        "model GPTNeoXForCausalLM (example_model): GPTNeoXForCausalLM declares no pipeline parallelism; "
        "set pipeline_parallel_size = 1 (2)"
    )
    assert main(["explain", "--model", path, "--pipeline-parallel-size", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {e.value}"
    with pytest.raises(
        TurnoutError, match="enable_expert_parallel is set, but LlamaForCausalLM has no experts"
    ):
        LLM(str(tiny_llama), enable_expert_parallel=True)


def test_backend_makes_each_layers_impl_and_the_groups_builder_before_kv_sizing(
    tiny_qwen3, register_plugin
) -> None:
    rec = _Recording()
    register_plugin(rec, "recording")
    prompts = _prompts(2, 3, 3, 20)
    llm = LLM(str(tiny_qwen3), cpu_kv_cache_bytes=1 << 22, block_size=4, attention_backend="recording")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    names = [e[0] for e in rec.events]
    # tiny_qwen3: 4 query heads, 1 KV head of 16, 2 plain layers, a float32 checkpoint on the CPU
    plain = tuple(AttentionLayerSpec(i, 16**-0.5) for i in range(2))
    spec = AttentionSpec(4, 1, 16, torch.float32, 4, 16**-0.5, num_layers=2, layers=plain)
    assert rec.events[:2] == [("make_impl", spec, plain[0]), ("make_impl", spec, plain[1])]
    assert names.count("make_impl") == 2 and ("make_builder", spec, 0) in rec.events
    assert names.index("make_builder") < names.index("kv_cache_shape") < names.index("build")
    assert {e[1] for e in rec.events if e[0] == "build"} == {0}  # one KV-cache group
    assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, prompts, GREEDY.max_tokens)


def test_spec_counts_heads_per_rank_and_layers_per_stage(tmp_path) -> None:
    """Under TP 2 x PP 2, rank (tp 1, pp 1) of a 4-layer model with 4 heads and 2 KV heads runs 2 heads,
    1 KV head and its stage's 2 layers, whose KV caches are 0 and 1."""
    from turnout.distributed import ParallelState, get_parallel_state, set_parallel_state
    from turnout.layers import Attention
    from turnout.layers.attention import bind_attention_layers
    from turnout.models import DecoderForCausalLM

    cfg = json.loads((make_tiny_model(tmp_path, "llama", num_hidden_layers=4) / "config.json").read_text())
    prev = get_parallel_state()
    set_parallel_state(ParallelState(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2))
    try:
        model = DecoderForCausalLM(cfg)
    finally:
        set_parallel_state(prev)
    spec = bind_attention_layers(model, torch.bfloat16, 16)
    plain = tuple(AttentionLayerSpec(i, 16**-0.5) for i in range(2))
    assert spec == AttentionSpec(2, 1, 16, torch.bfloat16, 16, 16**-0.5, num_layers=2, layers=plain)
    assert [m.layer_idx for m in model.modules() if isinstance(m, Attention)] == [0, 1]
    assert isinstance(model, CausalLM)


class NoLogits(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def load_weights(self, weights) -> set[str]:
        return {"w"}


class NoAttention(NoLogits):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class _Broken:
    def __init__(self, cls: str) -> None:
        self.cls = cls

    @hookimpl
    def turnout_model_architectures(self):
        return [ModelArchitecture("BrokenForCausalLM", f"test_model_contract:{self.cls}")]


@pytest.mark.parametrize(
    "cls,error",
    [
        ("NoLogits", r"NoLogits is not a torch.nn.Module implementing turnout.models.CausalLM \(missing: "
                     r"compute_logits\); see docs/writing-a-plugin.md"),
        ("NoAttention", r"model NoAttention has no turnout.layers.Attention layer"),
    ],
)  # fmt: skip
def test_a_model_outside_the_contract_is_one_clear_error(tmp_path, register_plugin, cls, error) -> None:
    path = make_tiny_model(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["BrokenForCausalLM"]}))
    register_plugin(_Broken(cls), "broken")
    with pytest.raises(TurnoutError, match=error):
        LLM(str(path), cpu_kv_cache_bytes=1 << 20)


def test_backend_must_declare_where_it_runs() -> None:
    """No defaults that would quietly refuse a backend on the CPU: device_types and dtypes are declared."""
    with pytest.raises(TypeError, match=r"Quiet must declare device_types, dtypes, e.g. name = "):

        class Quiet(AttentionBackend):
            name = "quiet"
            impl_cls = AttentionImpl


def test_the_guide_shows_the_example_model_plugin_verbatim() -> None:
    guide = (Path(__file__).parents[1] / "docs/writing-a-plugin.md").read_text()
    for name in ("__init__.py", "model.py"):
        assert (EXAMPLE_MODEL / "turnout_example_model" / name).read_text() in guide, name
