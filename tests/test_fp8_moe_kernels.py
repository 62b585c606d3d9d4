"""The Triton grouped GEMM on e4m3 experts with their scales (turnout.layers.expert_outputs_triton, as
turnout-fp8's MoE method runs it) against a float64 reference of the experts dequantized by the format's
formula (w = q * scale per row, or per bn x bk block). Off CUDA it runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from turnout_fp8.method import dequantize
from turnout_fp8.moe import kernel_fits

from turnout.layers import moe

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _interpreter(triton_kernels) -> None:
    triton_kernels(moe._kernel)


def _quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 q, float32 scale [N] per row or [N / bn, K / bk] per block); w ~ q * scale."""
    n, k = w.shape
    bn, bk = block or (1, k)
    amax = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3))
    s = (amax / 448).float()
    scale = s if block else s[:, 0]
    return (w / dequantize(torch.ones(n, k, dtype=FP8), scale, block)).clamp(-448, 448).to(FP8), scale


def _problem(t: int, e: int, k: int, h: int, i: int, block, seed: int = 0):
    """x, the FP8 experts and their scales in the kernel's layouts, the routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    q13, s13, q2, s2 = [], [], [], []
    for _ in range(e):
        q, s = _quantize(torch.randn(2 * i, h, generator=g) / h**0.5, block)
        q13.append(q), s13.append(s)
        q, s = _quantize(torch.randn(h, i, generator=g) / i**0.5, block)
        q2.append(q), s2.append(s)
    logits = torch.randn(t, e, generator=g)
    logits[:, e - 1] = -1e4  # one expert gets no token: its blocks must not exist
    weights, ids = moe.select_experts(logits, k, renormalize=True)
    return x, torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2), weights, ids


def _reference(x, q13, s13, q2, s2, block, weights, ids) -> torch.Tensor:
    """Token by token, expert by expert, in float64, on the experts dequantized."""
    w13 = [dequantize(q, s, block).double() for q, s in zip(q13, s13)]
    w2 = [dequantize(q, s, block).double() for q, s in zip(q2, s2)]
    out = torch.zeros(x.shape[0], q2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("block", [None, (32, 32), (16, 64)], ids=["channel", "block32", "block16x64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", [1, 37])
def test_fp8_expert_outputs_match_float64(block, dtype: torch.dtype, t: int) -> None:
    """Top-2 over 8 experts (one without tokens), H = 128, I = 64: per-row scales and two block shapes
    (block32: K tiles of 32 in blocks of 32; block16x64: 64-column blocks taken in tiles of up to 64),
    combined with the router weights: ||out - ref|| / ||ref|| within the compute dtype's rounding."""
    x, q13, s13, q2, s2, weights, ids = _problem(t, 8, 2, 128, 64, block)
    assert kernel_fits(block, 64)
    dev = lambda a: a.to(DEV)
    out = moe.expert_outputs_triton(dev(x.to(dtype)), dev(q13), dev(q2), dev(ids), (dev(s13), dev(s2), block))
    assert out.dtype == dtype and out.shape == (t * 2, 128)
    got = moe.combine(out.float(), dev(weights)).double().cpu()
    ref = _reference(x.to(dtype), q13, s13, q2, s2, block, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rel = float((got - ref).norm() / ref.norm())
    assert rel < tol, rel


def test_the_scales_are_applied_per_block_not_per_expert() -> None:
    """Scaling one block of one expert's w13 by 4 changes that expert's outputs by the dequantized
    reference's change, and no other expert's: a kernel that read one scale an expert fails."""
    block = (32, 32)
    x, q13, s13, q2, s2, weights, ids = _problem(37, 8, 2, 128, 64, block, seed=1)
    s13b = s13.clone()
    s13b[2, 1, 3] *= 4
    outs = [moe.expert_outputs_triton(x, q13, q2, ids, (s, s2, block)).double() for s in (s13, s13b)]
    ref = [_reference(x, q13, s, q2, s2, block, weights, ids) for s in (s13, s13b)]
    got = [moe.combine(o.float(), weights).double() for o in outs]
    assert not torch.allclose(got[0], got[1])
    assert float((got[1] - ref[1]).norm() / ref[1].norm()) < 1e-5
    untouched = ~(ids == 2).any(dim=1)
    assert torch.equal(got[0][untouched], got[1][untouched])


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["channel", "block32"])
def test_fp8_moe_method_keeps_fp8_experts_on_cuda_and_matches_the_dequantized_layer(block) -> None:
    """Fp8MoEMethod as it runs on CUDA (weights kept in e4m3, scales moved into the kernel's layout, the
    layer computing through apply) against the same checkpoint tensors loaded as on the CPU (dequantized
    at load, the torch MoE kernel), both fed per expert through the layer's loaders: one result in
    float32."""
    from turnout_fp8.moe import Fp8MoEMethod
    from turnout_fp8.scheme import Scheme

    from turnout.layers import FusedMoE

    scheme = Scheme("block", "group", "weight_scale_inv", block) if block else Scheme("channel", "token")
    x, q13, s13, q2, s2, _, _ = _problem(37, 8, 2, 128, 64, block, seed=2)
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(3))
    outs = []
    for cuda in (True, False):
        layer = FusedMoE(8, 2, 128, 64, renormalize=True).to(DEV)
        method = Fp8MoEMethod(
            scheme, "model.layers.0.mlp.experts", ["gate_proj", "up_proj", "down_proj"], cuda
        )
        layer.quant_method = method
        method.create_weights(layer)
        scale_13, scale_2 = (getattr(layer, f"{w}_{scheme.scale_name}") for w in ("w13", "w2"))
        for e in range(8):
            bn = block[0] if block else 1
            for part in (0, 1):  # the checkpoint's gate_proj and up_proj, with their own scales
                layer.w13_weight.weight_loader(layer.w13_weight, q13[e, part * 64 : (part + 1) * 64], e, part)
                s = s13[e, part * 64 // bn : (part + 1) * 64 // bn]
                scale_13.weight_loader(scale_13, s if block else s[:, None], e, part)
            layer.w2_weight.weight_loader(layer.w2_weight, q2[e], e, 2)
            scale_2.weight_loader(scale_2, s2[e] if block else s2[e][:, None], e, 2)
        method.process_weights_after_loading(layer)
        assert (layer.w13_weight.dtype == FP8) == cuda and (layer.quant_method is method) == cuda
        outs.append(layer(x.to(DEV), logits.to(DEV)).double().cpu())
    assert float((outs[0] - outs[1]).norm() / outs[1].norm()) < 1e-5
