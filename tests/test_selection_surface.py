"""Selection's public surface: a Choice for every component, and each chosen object behind an accessor
named for what it is (the older names `backend` and `architecture` keep working)."""

from __future__ import annotations

from pathlib import Path

from turnout.attention import AttentionBackend
from turnout.config import EngineConfig
from turnout.executor import ExecutorSpec
from turnout.graphs import GraphPolicy
from turnout.models import ModelArchitecture
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.selection import Choice, select_all

CPU = Platform("cpu", "cpu", 1, None, 1 << 34)
ACCESSORS = {  # kind -> (accessor of the chosen object, its type)
    "attention": ("attention_backend", AttentionBackend),
    "model": ("model_architecture", ModelArchitecture),
    "executor": ("executor_spec", ExecutorSpec),
    "graph": ("graph_policy", GraphPolicy),
}


def _select(path: Path, plugin_manager):
    return select_all(EngineConfig(tuned="off"), ModelInfo.from_dir(path), plugin_manager, CPU)


def test_every_component_is_a_choice_with_a_named_accessor(tiny_llama: Path, plugin_manager) -> None:
    sel = _select(tiny_llama, plugin_manager)
    assert [c.kind for c in sel.choices] == list(ACCESSORS)
    for kind, (name, cls) in ACCESSORS.items():
        choice = getattr(sel, kind)
        assert isinstance(choice, Choice) and choice.kind == kind
        assert getattr(sel, name) is choice.chosen.obj and isinstance(getattr(sel, name), cls), name
    assert sel.moe is None and sel.moe_kernel is None
    assert isinstance(sel.effective_graph, GraphPolicy)  # the graph policy as it runs
    assert sel.backend is sel.attention_backend and sel.architecture is sel.model_architecture


def test_moe_kernel_accessor(tmp_path: Path, plugin_manager) -> None:
    from transformers import Qwen3MoeConfig

    cfg = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    Qwen3MoeConfig(**cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32).save_pretrained(
        tmp_path
    )
    sel = _select(tmp_path, plugin_manager)
    assert isinstance(sel.moe, Choice) and sel.choices[-1] is sel.moe
    assert sel.moe_kernel is sel.moe.chosen.obj is not None
