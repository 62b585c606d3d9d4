"""On a CUDA machine with FP8: a Qwen3-MoE checkpoint whose experts are stored in FP8 keeps them in FP8 and
computes them with the core's Triton grouped GEMM (turnout.layers.expert_outputs_triton), eager and in CUDA
graphs, against HF transformers on the checkpoint dequantized. Only the experts are quantized (the
attention and router stay float32, named in the ignore list) and the engine runs float32, so the MoE
kernel's rounding is the one difference."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams

from tiny_models import dequantized_checkpoint, hf_greedy, make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm89+)", allow_module_level=True)

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(4 + 7 * i)] for i in range(4)]
NEW = 8


def _experts_in_fp8(src: Path, dst: Path, block: tuple[int, int] | None) -> Path:
    """src with every expert weight in e4m3: per-row scales ([N, 1]) or per bn x bk block scales (each
    scale the amax of its row or tile / 448), as compressed-tensors writes them; the rest as it is."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if ".mlp.experts." in n and n.endswith(".weight")]:
        w = tensors[name].double()
        n, k = w.shape
        bn, bk = block or (1, k)
        amax = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448
        full = amax.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        tensors[name] = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale"] = amax.float()  # [N, 1] or [N / bn, K / bk]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    weights = {**fp8, "dynamic": False, "strategy": "block" if block else "channel"}
    if block:
        weights["block_structure"] = list(block)
    act = {**fp8, "dynamic": True, "strategy": "group" if block else "token"}
    if block:
        act["group_size"] = block[1]
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}},
        "ignore": ["re:.*self_attn\\..*", "re:.*mlp\\.gate", "lm_head"],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
def test_fp8_moe_experts_stay_fp8_on_cuda_and_match_hf_dequantized(block, mode: str, tmp_path: Path) -> None:
    """The experts hold e4m3 after loading and explain's notes say the FP8 kernel computes them; greedy
    tokens equal HF's on the checkpoint dequantized and logprobs agree to 1e-3."""
    src = make_tiny_model(tmp_path / "src", "qwen3_moe", seed=5, hidden_size=128, **MOE)
    fp8 = _experts_in_fp8(src, tmp_path / "fp8", block)
    ref = dequantized_checkpoint(fp8, tmp_path / "ref")
    llm = LLM(str(fp8), dtype="float32", cudagraph_mode=mode)
    notes = " ".join(llm.engine.selection.quantization_notes)
    assert "fused MoE experts: FP8 weights, a Triton grouped GEMM" in notes, notes
    experts = llm.engine.executor.worker.runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.quant_method is not None
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    llm.shutdown()
    assert [o.token_ids for o in outs] == hf_greedy(ref, PROMPTS, NEW)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for prompt, o in zip(PROMPTS, outs):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + o.token_ids])).logits[0].double(), -1)
        want = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.token_ids)])
        assert float((got.double() - want).abs().max()) < 1e-3
