"""Selection rules: priority, ties, explicit choices, error messages, and a third-party backend."""

from __future__ import annotations

import types

import pytest
import torch

from turnout import hookimpl
from turnout.attention import AttentionBackend, AttentionContext
from turnout.config import EngineConfig
from turnout.errors import SelectionError
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.selection import Candidate, choose, select_all

from fake_dist import naive_backend_source

CPU = Platform("cpu", "cpu", 1, None, 1 << 34)
H200 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.float16, torch.float32, torch.bfloat16))


def _cands(*specs):
    return [Candidate("attention", n, "p", prio, reasons) for n, prio, reasons in specs]


def test_highest_priority_valid_wins_ties_by_name():
    c = choose("attention", _cands(("b", 5, []), ("a", 5, []), ("z", 9, ["nope"]), ("c", 1, [])))
    assert c.chosen.name == "a" and c.chosen.chosen
    assert [x.chosen for x in c.candidates] == [False, True, False, False]


def test_explicit_invalid_choice_names_reasons_and_options():
    with pytest.raises(SelectionError) as e:
        choose("attention", _cands(("x", 1, ["needs cuda"]), ("y", 0, [])), "x")
    msg = str(e.value)
    assert "'x' cannot be used: needs cuda" in msg and "valid here: y" in msg and "\n" not in msg


def test_explicit_unknown_choice_lists_installed():
    with pytest.raises(
        SelectionError, match=r"unknown attention backend 'nope'; installed: x, y; valid here: y"
    ):
        choose("attention", _cands(("x", 1, ["needs cuda"]), ("y", 0, [])), "nope")


def test_explicit_valid_lower_priority_choice_is_honoured():
    assert choose("attention", _cands(("hi", 9, []), ("lo", 0, [])), "lo").chosen.name == "lo"


def test_backend_check_reasons():
    class B(AttentionBackend):
        name, dtypes, head_sizes, block_size_multiple = "b", (torch.bfloat16,), (64, 128), 256
        device_types, min_capability = ("cuda",), (9, 0)

    ctx = AttentionContext(H200, torch.float32, 80, 8, 3, 16)
    reasons = B().check(ctx)
    assert len(reasons) == 4, reasons
    assert any("dtype float32" in r for r in reasons) and any("head size 80" in r for r in reasons)
    assert any("multiple of 256" in r for r in reasons) and any("not divisible" in r for r in reasons)
    cpu_reasons = B().check(AttentionContext(CPU, torch.bfloat16, 64, 8, 8, 256))
    assert cpu_reasons == ["needs device cuda, have cpu"]


def test_import_error_becomes_reason():
    class B(AttentionBackend):
        name, device_types, dtypes = "b", ("cpu",), (torch.float32,)

        def import_error(self):
            return "flash_attn is not installed (pip install turnout-flash-attn[gpu])"

    assert B().check(AttentionContext(CPU, torch.float32, 64, 4, 4, 16)) == [
        "flash_attn is not installed (pip install turnout-flash-attn[gpu])"
    ]


def _module(source: str) -> types.ModuleType:
    mod = types.ModuleType("inproc_backend")
    exec(compile(source, "inproc_backend", "exec"), mod.__dict__)
    return mod


def test_third_party_backend_wins_by_priority_and_config_picks(
    register_plugin, plugin_manager, tiny_llama, tmp_path
):
    register_plugin(_module(naive_backend_source(priority=100)), "naive_plugin")
    info = ModelInfo.from_dir(tiny_llama)
    sel = select_all(EngineConfig(), info, plugin_manager, CPU)
    assert sel.attention.chosen.name == "naive" and sel.attention.chosen.plugin == "naive_plugin"
    cfg = tmp_path / "t.toml"
    cfg.write_text('attention_backend = "cpu"\n')
    sel = select_all(EngineConfig.load(cfg), info, plugin_manager, CPU)
    assert sel.attention.chosen.name == "cpu"
    assert {c.name for c in sel.attention.candidates} >= {"cpu", "naive"}


def test_unknown_architecture_lists_installed(tiny_llama, tmp_path, plugin_manager):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SelectionError) as e:
        select_all(EngineConfig(), ModelInfo.from_dir(path), plugin_manager, CPU)
    msg = str(e.value)
    assert (
        "'FooForCausalLM'" in msg and "LlamaForCausalLM (llama)" in msg and "Qwen3ForCausalLM (qwen3)" in msg
    )
    assert "install a model plugin" in msg


def test_executor_auto_picks_multiproc_for_two_ranks(tiny_llama, plugin_manager):
    info = ModelInfo.from_dir(tiny_llama)
    sel = select_all(EngineConfig(), info, plugin_manager, CPU)
    assert sel.executor.chosen.name == "uniproc"
    sel = select_all(EngineConfig(tensor_parallel_size=2), info, plugin_manager, CPU)
    assert sel.executor.chosen.name == "multiproc"
    uni = next(c for c in sel.executor.candidates if c.name == "uniproc")
    assert uni.reasons == ["runs one rank, world size is 2"]
    with pytest.raises(SelectionError, match="'uniproc' cannot be used: runs one rank, world size is 2"):
        select_all(EngineConfig(tensor_parallel_size=2, executor="uniproc"), info, plugin_manager, CPU)


class _Policies:
    @hookimpl
    def turnout_graph_policies(self):
        from turnout.graphs.modes import GraphPolicy, RuntimeMode

        return [GraphPolicy("FULL", RuntimeMode.NONE, RuntimeMode.NONE)]


def test_duplicate_graph_policy_is_rejected_with_reason(register_plugin, plugin_manager, tiny_llama):
    register_plugin(_Policies(), "dup")
    sel = select_all(EngineConfig(cudagraph_mode="FULL"), ModelInfo.from_dir(tiny_llama), plugin_manager, CPU)
    fulls = [c for c in sel.graph.candidates if c.name == "FULL"]
    assert len(fulls) == 2 and sel.graph.chosen.plugin == "graphs"
    assert [c.reasons for c in fulls if c.plugin == "dup"] == [["name already registered by plugin graphs"]]


def test_auto_dtype_rules(tiny_llama):
    import dataclasses

    info = ModelInfo.from_dir(tiny_llama)  # saved as float32
    bf16 = dataclasses.replace(info, hf_config={**info.hf_config, "torch_dtype": "bfloat16"})
    cpu_bf16 = dataclasses.replace(CPU, native_bf16=True)
    assert info.resolve_dtype("auto", CPU) == torch.float32
    assert info.resolve_dtype("auto", cpu_bf16) == torch.float32  # a float32 checkpoint stays float32
    assert bf16.resolve_dtype("auto", cpu_bf16) == torch.bfloat16
    assert bf16.resolve_dtype("auto", CPU) == torch.float32  # no native bf16: float32
    assert info.resolve_dtype("auto", H200) == torch.bfloat16  # GPUs run float32 checkpoints in bf16
    assert bf16.resolve_dtype("float16", H200) == torch.float16  # explicit wins
