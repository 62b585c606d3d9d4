"""FP8 checkpoints (turnout-fp8) on the CPU: each format, for a Llama and for Qwen3-MoE's fused experts,
against HF transformers running the same checkpoint dequantized by the format's formula in float64, online
quantization against the unquantized model, and one-line refusals for what no method serves."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from turnout import LLM, SamplingParams, hookimpl
from turnout.bench.random_models import quantize_checkpoint
from turnout.errors import TurnoutError

from tiny_models import (
    chat_prompts,
    dequantized_checkpoint,
    hf_greedy,
    make_tiny_model,
    teacher_forced_agreement,
)

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
FORMATS = {
    "hf-block": dict(fmt="fp8", block=(16, 32)),
    "hf-tensor-static": dict(fmt="fp8", block=None, activations="static"),
    "ct-channel-dynamic": dict(fmt="compressed-tensors", weights="channel", activations="dynamic"),
    "ct-tensor-static": dict(fmt="compressed-tensors", weights="tensor", activations="static"),
}
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(4 + 5 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp8-src"), "llama", seed=3)


@pytest.fixture(scope="module", params=list(FORMATS))
def fp8_and_ref(request: pytest.FixtureRequest, tiny_bf16: Path, tmp_path_factory: pytest.TempPathFactory):
    fp8 = quantize_checkpoint(tiny_bf16, tmp_path_factory.mktemp(request.param), **FORMATS[request.param])
    ref = dequantized_checkpoint(fp8, tmp_path_factory.mktemp(request.param + "-ref"))
    return fp8, ref


def _hf_logprobs(path: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's logprob of each of tokens, teacher-forced after prompt, float32 forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_each_fp8_format_matches_hf_on_the_checkpoint_dequantized(fp8_and_ref) -> None:
    fp8, ref = fp8_and_ref
    llm = LLM(str(fp8), dtype="float32", cpu_kv_cache_bytes=1 << 22)
    assert llm.engine.selection.quantization.chosen.name == "fp8"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(ref, PROMPTS, MAX_NEW)
    lps = zip(outs[0].outputs[0].logprobs, outs[0].token_ids)
    ours = torch.tensor([lp[t].logprob for lp, t in lps], dtype=torch.float64)
    theirs = _hf_logprobs(ref, PROMPTS[0], outs[0].token_ids)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours, theirs)


def test_an_fp8_checkpoint_without_the_fp8_plugin_is_refused_with_one_line(
    tiny_bf16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp8 = quantize_checkpoint(tiny_bf16, tmp_path / "fp8", **FORMATS["ct-channel-dynamic"])
    monkeypatch.setenv("TURNOUT_PLUGINS", "llama,cpu,uniproc,graphs")
    from turnout.plugins import reset_plugin_manager

    reset_plugin_manager()
    try:
        with pytest.raises(TurnoutError) as e:
            LLM(str(fp8), dtype="float32", cpu_kv_cache_bytes=1 << 22)
    finally:
        monkeypatch.delenv("TURNOUT_PLUGINS")
        reset_plugin_manager()
    msg = str(e.value)
    assert "\n" not in msg and "quant_method" in msg and "install turnout-fp8" in msg


def _qkv_weight(llm: LLM) -> torch.Tensor:
    model = llm.engine.executor.worker.runner.model
    return next(m.weight for m in model.modules() if type(m).__name__ == "QKVParallelLinear")


def test_online_fp8_agrees_with_the_embedded_model_teacher_forced() -> None:
    """quantization = "fp8" on the embedded (unquantized) model: along the unquantized model's own greedy
    continuations, the FP8 model's argmax (teacher-forced, through prompt_logprobs) is the same token at
    most steps (42 of 48 measured in float32; per-channel FP8 of a 135M model's weights moves near-ties)."""
    base = LLM(cpu_kv_cache_bytes=1 << 24)
    prompts = chat_prompts(base, ["Name three rivers.", "What is a railway switch?"])
    cont = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    conts = [o.token_ids for o in base.generate(prompts, cont, use_tqdm=False)]
    fp8 = LLM(cpu_kv_cache_bytes=1 << 24, quantization="fp8")
    assert fp8.engine.selection.quantization.chosen.name == "fp8"
    assert not torch.equal(_qkv_weight(fp8), _qkv_weight(base))  # the weights went through FP8
    agree, steps = teacher_forced_agreement(fp8, prompts, conts)
    assert agree / steps >= 0.85, f"{agree}/{steps}"


def _edit_config(path: Path, dst: Path, edit) -> Path:
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


MALFORMED = {
    "unknown method": (lambda qc: qc.update(quant_method="awq"), "quant_method 'awq'"),
    "indivisible block": (lambda qc: qc.update(weight_block_size=[24, 32]), "does not divide"),
    "bad block": (lambda qc: qc.update(weight_block_size=[128]), "weight_block_size"),
    "static with blocks": (lambda qc: qc.update(activation_scheme="static"), "activation_scheme"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_quantization_config_fails_start_up_with_one_line(
    case: str, tiny_bf16: Path, tmp_path: Path
) -> None:
    _assert_refused(tiny_bf16, tmp_path, _edit_config, *MALFORMED[case])


def _assert_refused(
    tiny_bf16: Path, tmp_path: Path, edit_copy, edit, needle: str, fmt: str = "hf-block"
) -> None:
    """An FP8 checkpoint of format fmt, copied with edit applied by edit_copy, fails start-up with one line
    holding needle."""
    src = quantize_checkpoint(tiny_bf16, tmp_path / "fp8", **FORMATS[fmt])
    with pytest.raises(TurnoutError) as e:
        LLM(str(edit_copy(src, tmp_path / "bad", edit)), dtype="float32", cpu_kv_cache_bytes=1 << 22)
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


BAD_TENSORS = {
    "missing scale": (
        lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale_inv"),
        "lacks model.layers.1.self_attn.k_proj.weight_scale_inv",
    ),
    "scale of the wrong shape": (
        lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 2)}),
        "model.layers.0.mlp.up_proj.weight_scale_inv has shape (3, 2)",
    ),
    "weights not in FP8": (
        lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.ones(64, 64)}),
        "model.layers.0.self_attn.o_proj.weight is float32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_a_checkpoint_that_does_not_match_its_fp8_config_fails_with_the_tensor_named(
    case: str, tiny_bf16: Path, tmp_path: Path
) -> None:
    _assert_refused(tiny_bf16, tmp_path, _edit_tensors, *BAD_TENSORS[case])


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(tiny_bf16: Path, tmp_path: Path) -> None:
    from turnout.models.info import ModelInfo
    from turnout.platform import Platform
    from turnout.selection import select_all

    fp8 = quantize_checkpoint(tiny_bf16, tmp_path / "fp8", **FORMATS["hf-block"])
    a100 = Platform("cuda", "NVIDIA A100", 1, (8, 0), 80 << 30, (torch.float32, torch.bfloat16), True)
    from turnout.config import EngineConfig

    with pytest.raises(TurnoutError) as e:
        select_all(EngineConfig(model=str(fp8)), ModelInfo.from_dir(fp8), platform=a100)
    assert "\n" not in str(e.value) and "needs compute capability sm89+, have sm80" in str(e.value)


class _CudaOnlyFp8:
    """A third party's method for the same format that runs only on CUDA."""

    @hookimpl
    def turnout_quantization_methods(self, platform):
        from turnout.quantization import QuantizationMethod

        class CudaFp8(QuantizationMethod):
            name, checkpoint_formats, devices, priority = "cuda_fp8", ("fp8",), ("cuda",), 100

        return [CudaFp8()]


def test_every_method_is_a_candidate_with_its_reasons(
    register_plugin, plugin_manager, tiny_bf16: Path, tmp_path: Path
) -> None:
    from turnout.config import EngineConfig
    from turnout.models.info import ModelInfo
    from turnout.selection import select_all

    register_plugin(_CudaOnlyFp8(), "cuda_fp8_plugin")
    fp8 = quantize_checkpoint(tiny_bf16, tmp_path / "fp8", **FORMATS["hf-block"])
    sel = select_all(EngineConfig(model=str(fp8)), ModelInfo.from_dir(fp8), plugin_manager)
    cands = {c.name: c for c in sel.quantization.candidates}
    assert sel.quantization.chosen.name == "fp8" and cands["fp8"].valid
    assert cands["cuda_fp8"].reasons == ["needs device cuda, have cpu"]
    assert "quantization fp8" in sel.summary()


def test_fp8_block_scales_shard_over_tensor_parallel_ranks(tiny_bf16: Path, tmp_path: Path) -> None:
    """TP 2 over gloo: each rank keeps its rows (columns for o_proj and down_proj) of every fused part's
    weight and of its block scales; greedy tokens equal HF's on the checkpoint dequantized."""
    fp8 = quantize_checkpoint(tiny_bf16, tmp_path / "fp8", **FORMATS["hf-block"])
    ref = hf_greedy(dequantized_checkpoint(fp8, tmp_path / "ref"), PROMPTS[:2], MAX_NEW)
    llm = LLM(str(fp8), dtype="float32", cpu_kv_cache_bytes=1 << 22, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == ref
    finally:
        llm.shutdown()


# ---- fused MoE experts in FP8 (Qwen3-MoE) ----
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp8-moe-src"), "qwen3_moe", seed=5, **MOE)


@pytest.fixture(scope="module", params=list(FORMATS))
def moe_fp8_and_ref(request: pytest.FixtureRequest, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory):
    fp8 = quantize_checkpoint(
        tiny_moe, tmp_path_factory.mktemp("moe-" + request.param), **FORMATS[request.param]
    )
    ref = dequantized_checkpoint(fp8, tmp_path_factory.mktemp("moe-" + request.param + "-ref"))
    return fp8, ref


def _experts(llm: LLM, layer: int):
    return llm.engine.executor.worker.runner.model.model.layers[layer].mlp.experts


def test_fp8_moe_experts_in_each_format_match_hf_on_the_checkpoint_dequantized(moe_fp8_and_ref) -> None:
    """Every expert weight equals the format's formula applied to the checkpoint; greedy tokens equal HF's
    on the dequantized checkpoint, logprobs within 1e-4; the notes say the experts run in float32."""
    from safetensors.torch import load_file

    fp8, ref = moe_fp8_and_ref
    llm = LLM(str(fp8), dtype="float32", cpu_kv_cache_bytes=1 << 22)
    assert llm.engine.selection.quantization.chosen.name == "fp8"
    assert "fused MoE experts: dequantized to float32 at load" in " ".join(llm.selection.quantization_notes)
    want = load_file(ref / "model.safetensors")
    experts = _experts(llm, 1)
    assert experts.w13_weight.dtype == torch.float32 and experts.quant_method is None
    assert torch.equal(experts.w13_weight[5, 64:], want["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(experts.w2_weight[2], want["model.layers.1.mlp.experts.2.down_proj.weight"])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(ref, PROMPTS, MAX_NEW)
    lps = zip(outs[1].outputs[0].logprobs, outs[1].token_ids)
    ours = torch.tensor([lp[t].logprob for lp, t in lps], dtype=torch.float64)
    theirs = _hf_logprobs(ref, PROMPTS[1], outs[1].token_ids)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours, theirs)


def test_online_fp8_leaves_moe_experts_unquantized_and_says_so(tiny_moe: Path) -> None:
    from safetensors.torch import load_file

    llm = LLM(str(tiny_moe), dtype="float32", cpu_kv_cache_bytes=1 << 22, quantization="fp8")
    assert "fused MoE experts: not quantized" in llm.selection.quantization_notes[-1]
    src = load_file(tiny_moe / "model.safetensors")["model.layers.0.mlp.experts.4.gate_proj.weight"]
    assert torch.equal(_experts(llm, 0).w13_weight[4, :64], src)


@pytest.mark.parametrize(
    "fmt, parallel",
    [("hf-block", {}), ("ct-tensor-static", {"enable_expert_parallel": True})],
    ids=["hf-block-tp2", "ct-tensor-static-tp2-ep"],
)
def test_fp8_moe_scales_shard_over_tensor_and_expert_parallel_ranks(
    fmt: str, parallel: dict, tiny_moe: Path, tmp_path: Path
) -> None:
    """TP 2 over gloo: each rank keeps its rows of w13 and columns of w2 and of their block scales; with
    expert parallelism each rank keeps its experts whole, with their scales. Greedy tokens equal HF's on
    the checkpoint dequantized."""
    fp8 = quantize_checkpoint(tiny_moe, tmp_path / "fp8", **FORMATS[fmt])
    ref = hf_greedy(dequantized_checkpoint(fp8, tmp_path / "ref"), PROMPTS[:2], MAX_NEW)
    llm = LLM(str(fp8), dtype="float32", cpu_kv_cache_bytes=1 << 22, tensor_parallel_size=2, **parallel)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == ref
    finally:
        llm.shutdown()


BAD_MOE_TENSORS = {
    "missing scale": (
        "hf-block",
        lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"),
        "lacks model.layers.1.mlp.experts.5.up_proj.weight_scale_inv",
    ),
    "block scale of the wrong shape": (
        "hf-block",
        lambda t: t.update({"model.layers.0.mlp.experts.2.down_proj.weight_scale_inv": torch.ones(3, 2)}),
        "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv has shape (3, 2)",
    ),
    "channel scale of the wrong shape": (
        "ct-channel-dynamic",
        lambda t: t.update({"model.layers.1.mlp.experts.7.gate_proj.weight_scale": torch.ones(5, 1)}),
        "model.layers.1.mlp.experts.7.gate_proj.weight_scale has shape (5,)",
    ),
    "zero scale": (
        "ct-tensor-static",
        lambda t: t.update({"model.layers.0.mlp.experts.3.down_proj.weight_scale": torch.zeros(1)}),
        "has a zero or negative model.layers.0.mlp.experts.3.down_proj.weight_scale",
    ),
    "experts not in FP8": (
        "hf-block",
        lambda t: t.update({"model.layers.0.mlp.experts.1.gate_proj.weight": torch.ones(64, 64)}),
        "model.layers.0.mlp.experts.1.gate_proj.weight is float32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MOE_TENSORS))
def test_a_malformed_fp8_moe_expert_fails_start_up_with_the_tensor_named(
    case: str, tiny_moe: Path, tmp_path: Path
) -> None:
    fmt, edit, needle = BAD_MOE_TENSORS[case]
    _assert_refused(tiny_moe, tmp_path, _edit_tensors, edit, needle, fmt)


def test_fp8_moe_blocks_that_split_unevenly_over_tp_ranks_are_refused(tmp_path: Path) -> None:
    """moe_intermediate_size 48 over 2 ranks is 24 rows a rank, which 16-row blocks do not divide (the
    attention layers' rows and columns they do)."""
    src = make_tiny_model(tmp_path / "src", "qwen3_moe", seed=5, **{**MOE, "moe_intermediate_size": 48})
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", **FORMATS["hf-block"])
    with pytest.raises(TurnoutError) as e:
        LLM(str(fp8), dtype="float32", cpu_kv_cache_bytes=1 << 22, tensor_parallel_size=2)
    msg = str(e.value)
    assert "\n" not in msg and "[16, 32] does not divide model.layers.0.mlp.experts's 24" in msg, msg


class _LinearOnlyFp8:
    """A third party's method for the same format that quantizes linear layers only."""

    @hookimpl
    def turnout_quantization_methods(self, platform):
        from turnout.quantization import QuantizationMethod

        class LinearFp8(QuantizationMethod):
            name, checkpoint_formats, priority = "linear_fp8", ("fp8",), 100

        return [LinearFp8()]


def test_a_method_that_does_not_replace_moe_is_no_candidate_for_fp8_experts(
    register_plugin, plugin_manager, tiny_moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The method that replaces "moe" wins over a higher-priority one that does not, and explain says the
    experts run in the compute dtype."""
    from turnout.config import EngineConfig
    from turnout.models.info import ModelInfo
    from turnout.selection import select_all

    register_plugin(_LinearOnlyFp8(), "linear_fp8_plugin")
    fp8 = quantize_checkpoint(tiny_moe, tmp_path / "fp8", **FORMATS["hf-block"])
    sel = select_all(EngineConfig(model=str(fp8)), ModelInfo.from_dir(fp8), plugin_manager)
    cands = {c.name: c for c in sel.quantization.candidates}
    assert sel.quantization.chosen.name == "fp8"
    assert cands["linear_fp8"].reasons == [
        "does not quantize fused MoE experts, which this checkpoint stores quantized"
    ]
    assert sel.quantization_notes[-1].startswith("fused MoE experts: dequantized to float32 at load")
    from turnout.cli import main

    assert main(["explain", "--model", str(fp8), "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "quantization fp8:" in text and "fused MoE experts: dequantized to float32 at load" in text
    assert main(["explain", "--json", "--model", str(fp8), "--dtype", "bfloat16"]) == 0
    doc = json.loads(capsys.readouterr().out)["quantization"]
    assert doc["method"] == "fp8" and "run in bfloat16" in doc["layers"][-1]
