"""The bundled DeepSeek-V2 plugin generates like HF transformers' DeepseekV2ForCausalLM (float32, each prompt
alone, eager attention): greedy tokens exactly for 8 prompts, batched and one at a time, on prefix-cache hits,
with chunked prefill, under tensor (and expert, and pipeline) parallelism over gloo, and with the Triton
attention backend and MoE kernel in Triton's interpreter. Two tiny random checkpoints cover both query paths
(q_lora_rank set and None), YaRN rope with mscale_all_dim (and default rope), both top-k methods
(group_limited_greedy with n_group / topk_group, greedy), routed_scaling_factor, one and two shared experts,
a dense first layer (first_k_dense_replace = 1), attention biases, and v_head_dim above and below the q/k
head size. The KV cache holds the latent vector (kv_lora_rank + qk_rope_head_dim a token and layer), which
flash_attn and flashinfer cannot serve, in the model dtype only. The router is checked against HF's alone; a
config value the plugin does not implement, and a checkpoint missing one expert's tensor, are refused in one
line."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from turnout_deepseek_v2.model import deepseek_routing

from turnout import LLM, SamplingParams, TurnoutError
from turnout.attention.kv_spec import FullAttentionSpec, MLAAttentionSpec, kv_cache_config
from turnout.bench.random_models import LINEAR_NAMES, quantize_checkpoint
from turnout.layers import moe
from turnout.models.info import ModelInfo
from turnout.platform import Platform

from tiny_models import (
    TOKENIZER_VOCAB,
    assert_matches_reference,
    assert_parallel_matches_reference,
    checkpoints,
    dequantized_checkpoint,
    hf_greedy,
    write_tokenizer,
)

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW = {"dtype": "float32", "cpu_kv_cache_bytes": 1 << 22, "block_size": 4}
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
    first_k_dense_replace=1, num_experts_per_tok=2, max_position_embeddings=512, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
CONFIGS = {  # case -> its own keys
    # DeepSeek-V2's shape: q through the LoRA pair, YaRN, group-limited routing, v narrower than q/k (16 < 32)
    "lora-yarn-grouped": dict(num_hidden_layers=3, q_lora_rank=48, v_head_dim=16, n_routed_experts=8,
                              n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5, rope_parameters=YARN),
    # DeepSeek-V2-Lite's: q_proj, greedy routing; here also biases and v wider than q/k (40 > 32)
    "q-proj-greedy": dict(num_hidden_layers=2, q_lora_rank=None, v_head_dim=40, n_routed_experts=4,
                          n_shared_experts=2, topk_method="greedy", attention_bias=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}  # fmt: skip

H200 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.float16, torch.bfloat16, torch.float32))
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, TOKENIZER_VOCAB) for _ in range(_rng.randrange(10, 40))] for _ in range(8)]


def _write(path: Path, case: str) -> Path:
    """A tiny random checkpoint, weights widened so that logits are far from ties."""
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(**COMMON, **CONFIGS[case])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            # matrices N(0, 0.2); norms (initialised to ones) N(1, 0.1), biases (zeros) N(0, 0.1)
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1.0 if p.abs().sum() else 0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def _hf_greedy(path: Path) -> list[list[int]]:
    return hf_greedy(path, PROMPTS, MAX_NEW, attn_implementation="eager")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(case) -> (its tiny checkpoint, HF's greedy tokens for PROMPTS), each written once."""
    return checkpoints(tmp_path_factory.mktemp, _write, _hf_greedy)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_greedy_matches_hf(checkpoint, case: str) -> None:
    """Batched, then each prompt again alone (every one a prefix hit), then chunked by a 16-token budget."""
    path, ref = checkpoint(case)
    llm = LLM(str(path), **KW)
    model, experts = llm.selection.model.chosen, llm.selection.moe.chosen
    assert (model.name, model.plugin, experts.name) == ("DeepseekV2ForCausalLM", "deepseek_v2", "torch")
    assert_matches_reference(llm, path, ref, PROMPTS, GREEDY, **KW)


def test_cache_holds_the_latent_vector(checkpoint) -> None:
    """Every layer's KV tensor holds kv_lora_rank + qk_rope_head_dim values a token (one latent head, no
    separate K and V), the MLA spec sizes it, and the same memory holds that many more blocks than per-head
    K and V (padded to max(qk_nope + qk_rope, v_head_dim)) did."""
    path, _ = checkpoint("q-proj-greedy")
    llm = LLM(str(path), **KW)
    runner = llm.engine.executor.worker.runner
    cfg = json.loads((path / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # 32 + 8
    info = ModelInfo.from_dir(path)
    assert (info.head_size, info.num_kv_heads, info.kv_lora_rank) == (latent, 1, 32)
    attns = [layer.self_attn for layer in runner.model.model.layers]
    assert {(a.attn.num_heads, a.attn.num_kv_heads, a.attn.head_size) for a in attns} == {(4, 1, latent)}
    assert len({id(a.rotary) for a in attns}) == 1 and attns[0].rotary.cos.shape[1] == 8 // 2  # rope dims
    (spec,) = set(runner.kv_cache_specs())
    assert isinstance(spec, MLAAttentionSpec) and spec.page_size_bytes == KW["block_size"] * latent * 4
    layers, blocks = len(attns), llm.engine.num_blocks
    assert [tuple(t.shape) for t in runner.kv_cache_tensors] == [
        (blocks, KW["block_size"], 1, latent)
    ] * layers
    per_token = [t.numel() // (blocks * KW["block_size"]) for t in runner.kv_cache_tensors]
    assert per_token == [latent] * layers
    standard = 2 * cfg["num_attention_heads"] * max(32, cfg["v_head_dim"])  # per-head K and V: 2 x 4 x 40
    budget = KW["cpu_kv_cache_bytes"]
    assert blocks == budget // (layers * KW["block_size"] * latent * 4)
    assert blocks // (budget // (layers * KW["block_size"] * standard * 4)) == standard // latent == 8
    assert [g.spec.describe() for g in llm.engine.kv_cache_config.groups] == ["mla 32+8"]


def test_deepseek_v2_lite_takes_576_values_a_token_and_layer() -> None:
    """DeepSeek-V2-Lite's shape: 512 + 64 latent values a token and layer, 1,152 bytes in bfloat16, against
    per-head K and V's 2 x 16 x 192 (12,288 bytes)."""
    lite = MLAAttentionSpec(16, 1, 512 + 64, torch.bfloat16, 512)
    assert lite.bytes_per_token == 1152 and lite.page_size_bytes == 16 * 1152
    assert FullAttentionSpec(16, 16, 192, torch.bfloat16).bytes_per_token == 12288
    assert kv_cache_config([[lite] * 27]).describe() == ["group 0: mla 512+64, 27 layers"]


def test_flash_attn_and_flashinfer_cannot_serve_the_latent_cache(checkpoint, triton_kernels) -> None:
    """On an H200 the selection refuses them with the reason and runs Triton alone: no per-phase pair.
    (Off CUDA Triton's kernels are checked as the interpreter imports them.)"""
    triton_kernels()
    from turnout_deepseek_v2 import turnout_model_architectures

    from turnout.plugins import PluginManager
    from turnout.selection import attention_candidates, attention_context, choose_attention

    path, _ = checkpoint("q-proj-greedy")
    (arch,) = turnout_model_architectures()
    ctx = attention_context(ModelInfo.from_dir(path), arch, H200, torch.bfloat16, 16)
    assert ctx.kv_cache_specs == {"mla"} and ctx.kv_lora_rank == 32
    pm = PluginManager()
    pm.load_entry_points()
    candidates = attention_candidates(pm, ctx)
    reasons = {c.name: c.reasons for c in candidates}
    for name in ("flash_attn", "flashinfer"):
        assert "KV-cache spec mla unsupported (serves full)" in reasons[name], reasons[name]
    assert choose_attention(candidates, "auto", ctx).chosen.name == "triton"
    with pytest.raises(TurnoutError, match="KV-cache spec mla unsupported") as e:
        LLM(str(path), attention_backend="flashinfer", **KW)
    assert "\n" not in str(e.value)


def test_an_fp8_kv_cache_is_refused(checkpoint) -> None:
    """The latent cache runs in the model dtype only: kv_cache_dtype fp8 is one line, before any load."""
    path, _ = checkpoint("q-proj-greedy")
    with pytest.raises(TurnoutError, match="kv_cache_dtype fp8 unsupported for DeepseekV2ForCausalLM") as e:
        LLM(str(path), kv_cache_dtype="fp8", **KW)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_kv_b_proj_matches_hf_dequantized(checkpoint, tmp_path: Path, device: str, monkeypatch) -> None:
    """kv_b_proj (with the other projections and the experts) in HF's block FP8: the absorbed W_UK and W_UV
    are the checkpoint's kv_b_proj dequantized (dequantized at load on the CPU, read off its FP8 GEMM on
    CUDA), and greedy tokens equal HF's on the checkpoint dequantized. On CUDA every FP8 linear takes the
    GEMV, whose activations stay unquantized; the routes that quantize them to FP8 differ from the
    dequantized checkpoint by that rounding, and tests/test_fp8_gpu.py checks each against float64."""
    if device == "cuda" and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs a CUDA GPU with FP8 (sm89+)")
    if device == "cuda":
        from turnout_fp8 import kernels

        monkeypatch.setitem(kernels.ROUTES, "block", [(1 << 62, "gemv")])
    path, _ = checkpoint("q-proj-greedy")
    names = (*LINEAR_NAMES, "kv_b_proj")
    fp8 = quantize_checkpoint(path, tmp_path / "fp8", block=(16, 32), linear_names=names)
    ref = dequantized_checkpoint(fp8, tmp_path / "ref")
    llm = LLM(str(fp8), max_num_seqs=len(PROMPTS), **KW)  # few graphs and warm-up widths to compile on CUDA
    assert llm.selection.quantization.chosen.name == "fp8"
    attn = llm.engine.executor.worker.runner.model.model.layers[0].self_attn
    assert (attn.kv_b_proj.quant_method is not None) == (device == "cuda")
    want = load_file(ref / "model.safetensors")["model.layers.0.self_attn.kv_b_proj.weight"]
    w_uk, w_uv = attn.absorbed(torch.float32)
    got = torch.cat([w_uk, w_uv], 1).reshape(want.shape)
    torch.testing.assert_close(got.cpu(), want.float(), rtol=0, atol=0)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(ref, PROMPTS, MAX_NEW, attn_implementation="eager")


PARALLEL = [
    pytest.param("lora-yarn-grouped", dict(tensor_parallel_size=2), id="lora-yarn-tp2"),
    pytest.param("q-proj-greedy", dict(tensor_parallel_size=2), id="q-proj-tp2"),
    pytest.param("lora-yarn-grouped", dict(tensor_parallel_size=2, enable_expert_parallel=True), id="tp2-ep"),
    pytest.param("lora-yarn-grouped", dict(pipeline_parallel_size=2), id="pp2"),
]


@pytest.mark.parametrize("case,parallel", PARALLEL)
def test_parallel_matches_hf(checkpoint, case: str, parallel: dict) -> None:
    """Two ranks over gloo, chunked prefill on four prompts, then two of them again as prefix hits."""
    assert_parallel_matches_reference(*checkpoint(case), PROMPTS, GREEDY, parallel, **KW)


def test_triton_in_the_interpreter_matches_hf(checkpoint, triton_kernels) -> None:
    """Triton's attention kernels and grouped-GEMM experts (in the interpreter off CUDA): two prompts
    chunked by a 16-token budget, then one again as a prefix hit; HF's first three tokens (the interpreter is
    slow)."""
    triton_kernels(moe._kernel)
    path, ref = checkpoint("lora-yarn-grouped")
    llm = LLM(str(path), max_num_batched_tokens=16, attention_backend="triton", moe_kernel="triton", **KW)
    assert (llm.selection.attention.chosen.name, llm.selection.moe.chosen.name) == ("triton", "triton")
    three = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    two = [PROMPTS[0], PROMPTS[3]]
    outs = llm.generate(two + [PROMPTS[0]], three, use_tqdm=False)
    assert min(map(len, two)) > 16 and [o.token_ids for o in outs] == [ref[0][:3], ref[3][:3], ref[0][:3]]
    assert outs[2].num_cached_tokens >= len(PROMPTS[0]) - 4, outs[2].num_cached_tokens


@pytest.mark.parametrize("case", list(CONFIGS))
def test_router_matches_hf(case: str) -> None:
    """deepseek_routing gives HF's DeepseekV2TopkRouter's experts and weights, token by token."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(**COMMON, **CONFIGS[case])
    torch.manual_seed(1)
    hf = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(50, config.hidden_size)
    logits, hf_weights, hf_ids = hf(x)
    weights, ids = deepseek_routing(config.to_dict())(logits, config.num_experts_per_tok, False)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


WRONG = [  # config.json key, a value the plugin does not implement, the line that says so
    ("norm_topk_prob", True, "sets norm_topk_prob = True, which changes the model's math and DeepseekV2"),
    ("topk_method", "noaux_tc", "sets topk_method = 'noaux_tc', which changes the model's math and Deep"),
    ("scoring_func", "sigmoid", "sets scoring_func = 'sigmoid', which changes the model's math"),
    ("moe_layer_freq", 2, "sets moe_layer_freq = 2, which changes the model's math"),
    ("num_key_value_heads", 2, "sets num_key_value_heads = 2, which changes the model's math"),
    ("n_group", 3, "group_limited_greedy needs n_group dividing n_routed_experts \\(8\\)"),
    ("rope_parameters", {"rope_type": "proportional", "rope_theta": 1e4},
     "config.json's rope scaling: rope scaling 'proportional' is not supported"),
]  # fmt: skip


@pytest.mark.parametrize("key,value,why", WRONG, ids=[w[0] for w in WRONG])
def test_what_the_plugin_does_not_implement_is_refused(checkpoint, tmp_path: Path, key, value, why) -> None:
    """One line naming the config key, before any weight loads."""
    path = Path(shutil.copytree(checkpoint("lora-yarn-grouped")[0], tmp_path / "ckpt"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(TurnoutError, match=why) as e:
        LLM(str(path), **KW)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name", ["model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
             "model.layers.1.mlp.shared_experts.gate_proj.weight"],
)  # fmt: skip
def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(checkpoint, tmp_path: Path, name: str) -> None:
    """One line naming the missing checkpoint tensor, and no start."""
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(checkpoint("lora-yarn-grouped")[0], tmp_path / "ckpt"))
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TurnoutError, match=f"the checkpoint lacks {re.escape(name)}, which fills ") as e:
        LLM(str(path), **KW)
    assert "\n" not in str(e.value)


def test_a_random_moe_checkpoint_stores_each_expert_as_the_hub_does(tmp_path: Path, monkeypatch) -> None:
    """turnout bench's random DeepSeek-V2-Lite, in a small copy of its shape: experts written one matrix
    each (`experts.{e}.gate_proj.weight`), which HF loads with no missing key and turnout answers as HF."""
    from transformers import AutoModelForCausalLM

    from turnout.bench import random_models

    arch, lite = random_models.SHAPES["deepseek-v2-lite"]
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                 vocab_size=TOKENIZER_VOCAB, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
                 v_head_dim=16)  # fmt: skip
    monkeypatch.setitem(random_models.SHAPES, "small-lite", (arch, {**lite, **small}))
    path = random_models.make_random_model(tmp_path / "m", "small-lite")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    prompt = [5, 17, 99, 200, 31]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt) :]
    llm = LLM(str(path), **KW)
    got = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    assert list(got) == want.tolist()
