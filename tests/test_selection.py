"""Selection rules: priority, ties, explicit choices, error messages, and a third-party backend."""

from __future__ import annotations

import re
import types

import pytest
import torch

from turnout import Priority, hookimpl
from turnout.attention import AttentionBackend, AttentionContext
from turnout.config import EngineConfig
from turnout.errors import SelectionError
from turnout.executor import ExecutorContext
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.selection import OWN_PROCESSES, Candidate, Loss, choose, select_all, select_executor

from fake_dist import naive_backend_source

CPU = Platform("cpu", "cpu", 1, None, 1 << 34)
H200 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.float16, torch.float32, torch.bfloat16))


def _cands(*specs):
    return [Candidate("attention", n, "p", prio, reasons) for n, prio, reasons in specs]


def test_highest_priority_valid_wins_ties_by_name():
    c = choose("attention", _cands(("b", 5, []), ("a", 5, []), ("z", 9, ["nope"]), ("c", 1, [])))
    assert c.chosen.name == "a" and c.chosen.chosen
    assert [x.chosen for x in c.candidates] == [False, True, False, False]


def test_explicit_choice_among_same_named_candidates_goes_by_priority_then_plugin():
    cands = [Candidate("attention", "x", p, prio, []) for p, prio in (("p1", 0), ("p3", 7), ("p2", 7))]
    assert choose("attention", cands, "x").chosen.plugin == "p2"


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


class _Qwen3Elsewhere:
    """A third-party plugin that provides Qwen3ForCausalLM too (the bundled class, at its own priority)."""

    def __init__(self, priority: int) -> None:
        self.priority = priority

    @hookimpl
    def turnout_model_architectures(self):
        from turnout.models import ModelArchitecture

        return [ModelArchitecture("Qwen3ForCausalLM", "turnout_qwen3.model:Qwen3ForCausalLM", self.priority)]


def test_third_party_architecture_at_higher_priority_wins(register_plugin, plugin_manager, tiny_qwen3):
    """The hookspec's promise: among plugins offering one architecture the highest priority wins, ties by
    plugin name. zzz_models sorts after qwen3 and registers after it, so only its priority can win."""
    info = ModelInfo.from_dir(tiny_qwen3)
    register_plugin(_Qwen3Elsewhere(50), "zzz_models")
    sel = select_all(EngineConfig(), info, plugin_manager, CPU)
    assert (sel.model.chosen.plugin, sel.model.chosen.priority) == ("zzz_models", 50)
    bundled = next(c for c in sel.model.candidates if c.plugin == "qwen3")
    assert sel.model.why_lost(bundled) == "priority 0 < plugin zzz_models 50"


def test_architecture_tie_goes_to_the_plugin_name(register_plugin, plugin_manager, tiny_qwen3):
    info = ModelInfo.from_dir(tiny_qwen3)
    register_plugin(_Qwen3Elsewhere(0), "zzz_models")
    sel = select_all(EngineConfig(), info, plugin_manager, CPU)
    assert sel.model.chosen.plugin == "qwen3"
    late = next(c for c in sel.model.candidates if c.plugin == "zzz_models")
    assert sel.model.why_lost(late) == "priority 0 = plugin qwen3 0; 'qwen3' sorts first"
    register_plugin(_Qwen3Elsewhere(0), "aaa_models")
    assert select_all(EngineConfig(), info, plugin_manager, CPU).model.chosen.plugin == "aaa_models"


class _AnotherCpu:
    @hookimpl
    def turnout_attention_backends(self, platform):
        from turnout_cpu.backend import CPUAttentionBackend

        class FasterCpu(CPUAttentionBackend):
            priority = 50

        return [FasterCpu()]


def test_a_named_backend_offered_twice_goes_to_higher_priority(register_plugin, plugin_manager, tiny_llama):
    register_plugin(_AnotherCpu(), "zzz_cpu")
    cfg = EngineConfig(attention_backend="cpu")
    sel = select_all(cfg, ModelInfo.from_dir(tiny_llama), plugin_manager, CPU)
    assert (sel.attention.chosen.name, sel.attention.chosen.plugin) == ("cpu", "zzz_cpu")


def test_why_each_valid_candidate_lost(register_plugin, plugin_manager, tiny_llama):
    register_plugin(_module(naive_backend_source(priority=-5)), "naive_plugin")
    info = ModelInfo.from_dir(tiny_llama)
    att = select_all(EngineConfig(), info, plugin_manager, CPU).attention
    why = {c.name: att.why_lost(c) for c in att.candidates}
    assert why["naive"] == "priority -5 < cpu 0" and why["cpu"] == ""
    assert att.loss(next(c for c in att.candidates if c.name == "naive")) is Loss.PRIORITY
    assert all(why[c.name] == "" for c in att.candidates if not c.valid)  # they have reasons instead
    att = select_all(EngineConfig(attention_backend="naive"), info, plugin_manager, CPU).attention
    cpu = next(c for c in att.candidates if c.name == "cpu")
    assert att.why_lost(cpu) == "not requested (attention_backend = naive)"
    ties = choose("attention", _cands(("b", 5, []), ("a", 5, [])))
    assert ties.why_lost(ties.candidates[0]) == "priority 5 = a 5; 'a' sorts first"


def test_the_documented_order_per_platform(plugin_manager):
    """turnout.Priority's table: triton > flashinfer > flash_attn on CUDA; uniproc > ray > multiproc."""
    from turnout.selection import attention_candidates, executor_candidates

    ctx = AttentionContext(H200, torch.bfloat16, 128, 16, 8, 16)
    prio = {c.name: c.priority for c in attention_candidates(plugin_manager, ctx)}
    assert prio["triton"] == Priority.FIRST and prio["flashinfer"] == Priority.SECOND
    assert prio["flash_attn"] == Priority.THIRD and prio["cpu"] == Priority.DEFAULT
    prio = {c.name: c.priority for c in executor_candidates(plugin_manager, ExecutorContext(CPU, 2, False))}
    assert prio["uniproc"] > prio["ray"] > prio["multiproc"]


def test_data_parallel_on_cuda_needs_an_executor_with_processes_of_its_own(plugin_manager):
    gpus = Platform("cuda", "H200", 4, (9, 0), 141 << 30)
    dp2 = EngineConfig(data_parallel_size=2)
    choice = select_executor(plugin_manager, dp2, gpus)
    assert choice.chosen.name == "multiproc" and not choice.chosen.obj.in_process
    uni = next(c for c in choice.candidates if c.name == "uniproc")
    assert uni.reasons == [OWN_PROCESSES]
    with pytest.raises(SelectionError, match="'uniproc' cannot be used: runs the model in the engine's"):
        select_executor(plugin_manager, dp2.model_copy(update={"executor": "uniproc"}), gpus)
    assert select_executor(plugin_manager, dp2, CPU).chosen.name == "uniproc"  # replicas share this process


class _PlainBackend:
    """A backend that declares no per-layer features."""

    @hookimpl
    def turnout_attention_backends(self, platform):
        from turnout_cpu.backend import CPUAttentionBackend

        class Plain(CPUAttentionBackend):
            name = "plain"
            attention_features = frozenset()  # the CPU impl's, serving none

        return [Plain()]


def _windowed(hf_config: dict) -> tuple[str, ...]:
    return ("sliding_window", "logits_soft_cap")


class _WindowedLlama:
    """Llama's class, declared as if its layers had a sliding window and a logit soft-cap."""

    @hookimpl
    def turnout_model_architectures(self):
        from turnout.models import ModelArchitecture

        target = "turnout_llama.model:LlamaForCausalLM"
        return [ModelArchitecture("LlamaForCausalLM", target, 50, attention_features=_windowed)]


def test_a_backend_without_a_layer_feature_is_refused_with_its_reason(
    register_plugin, plugin_manager, tiny_llama, capsys
):
    """The model's declared per-layer features are checked against each backend's attention_features: a
    backend lacking one is invalid with one line, which explain shows and naming it raises; for a model
    without them the same backend is valid."""
    from turnout.cli import main

    register_plugin(_PlainBackend(), "plain_plugin")
    info = ModelInfo.from_dir(tiny_llama)
    plain_cfg = EngineConfig(attention_backend="plain")
    assert select_all(plain_cfg, info, plugin_manager, CPU).attention.chosen.name == "plain"
    register_plugin(_WindowedLlama(), "windowed")
    sel = select_all(EngineConfig(), info, plugin_manager, CPU)
    why = "per-layer logits_soft_cap, sliding_window unsupported (supports none)"
    reasons = {c.name: c.reasons for c in sel.attention.candidates}
    assert reasons["plain"] == [why] and sel.attention.chosen.name == "cpu" and reasons["cpu"] == []
    assert why in reasons["flashinfer"]  # declares none either
    with pytest.raises(
        SelectionError, match=re.escape(f"backend 'plain' cannot be used: {why}; valid here: cpu")
    ):
        select_all(plain_cfg, info, plugin_manager, CPU)
    capsys.readouterr()
    assert main(["explain", "--model", str(tiny_llama)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["plain"])
    assert why in row


class _TwoCpuBackends:
    @hookimpl
    def turnout_attention_backends(self, platform):
        from turnout_cpu.backend import CPUAttentionBackend

        class DecodeFirst(CPUAttentionBackend):
            name, priority = "decode_first", 40

        class MixedFirst(CPUAttentionBackend):
            name, priority, mixed_priority = "mixed_first", 5, 50

        return [DecodeFirst(), MixedFirst()]


def test_plugins_order_is_the_order_selection_follows(register_plugin, plugin_manager, tiny_llama):
    """attention_order (turnout plugins --order) per phase: the first backend that can run here is the one
    "auto" selects for that phase, and the rest follow by priority for the phase, then name."""
    from turnout.selection import attention_order

    register_plugin(_TwoCpuBackends(), "two_cpu")
    rows = {(r.platform, r.phase): r for r in attention_order(plugin_manager, CPU)}
    assert {p for p, _ in rows} == {"cpu", "cuda sm80", "cuda sm90"} and rows["cpu", "decode"].here
    runnable = {ph: [c.name for c in rows["cpu", ph].backends if not c.reasons] for ph in ("decode", "mixed")}
    assert runnable == {
        "decode": ["decode_first", "mixed_first", "cpu"],
        "mixed": ["mixed_first", "decode_first", "cpu"],
    }
    att = select_all(EngineConfig(), ModelInfo.from_dir(tiny_llama), plugin_manager, CPU).attention
    assert {ph: c.name for ph, c in att.phases.items()} == {"decode": "decode_first", "mixed": "mixed_first"}
    cuda = rows["cuda sm90", "decode"]
    assert [c.name for c in cuda.backends][:3] == ["triton", "flashinfer", "flash_attn"]
    assert not any(c.plugin == "two_cpu" for c in cuda.backends)  # they declare the CPU alone
    assert cuda.describe().startswith("triton 30 > flashinfer 20")
    assert rows["cpu", "mixed"].as_dict()["order"][0] == {
        "name": "mixed_first",
        "plugin": "two_cpu",
        "priority": 50,
        "reasons": [],
    }
