"""The MoE kernels of layers/moe.py against a float64 reference, the router against HF's, and the kernel
choice. Off CUDA the Triton grouped GEMM runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnout.layers import moe
from turnout.platform import Platform
from turnout.selection import moe_candidates

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = {"triton": moe.expert_outputs_triton, "torch": moe.expert_outputs_torch}


@pytest.fixture(autouse=True)
def _interpreter(triton_kernels) -> None:
    triton_kernels(moe._kernel)


def _tol(dtype: torch.dtype) -> float:
    # the interpreter has no bfloat16: it truncates where CUDA rounds to nearest
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


def _problem(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    logits = torch.randn(t, e, generator=g)
    logits[:, e - 1] = -1e4  # one expert gets no token: its blocks must not exist
    weights, ids = moe.select_experts(logits, k, renormalize=True)
    cast = lambda a: a.to(DEV, dtype)
    return cast(x), cast(w13), cast(w2), weights.to(DEV), ids.to(DEV)


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j].double().cpu() * (w2[e] @ (F.silu(gate) * up))
    return out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [1, 3, 37, 120, 300])
def test_expert_outputs_match_float64(kernel: str, dtype: torch.dtype, t: int) -> None:
    """Top-2 over 8 experts: 1 to 37 tokens take the 16-row tiles, 120 the 32-row and 300 the 64-row ones,
    in runs of several blocks. H = 48 and I = 40 are not multiples of the tiles: the masks must hold."""
    x, w13, w2, weights, ids = _problem(t, 8, 2, 48, 40, dtype, seed=t)
    out = moe.combine(KERNELS[kernel](x, w13, w2, ids), weights)
    assert out.dtype == dtype and out.shape == (t, 48)
    assert _rel(out, _reference(x, w13, w2, weights, ids)) < _tol(dtype)


def test_triton_and_torch_agree_on_top1_rows_of_local_experts() -> None:
    """What an expert-parallel rank computes: rows that arrived with one local expert each, no weights."""
    x, w13, w2, _, ids = _problem(19, 4, 1, 32, 16, torch.float32)
    a = moe.expert_outputs_triton(x, w13, w2, ids)
    b = moe.expert_outputs_torch(x, w13, w2, ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert moe.expert_outputs_triton(x[:0], w13, w2, ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("block_m", [4, 16])
def test_moe_align_sorts_pairs_into_padded_expert_runs(block_m: int) -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3], [3, 2]])
    sorted_ids, expert_ids, post = moe.moe_align(ids, 6, block_m)
    p, flat = ids.numel(), ids.flatten()
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    used = sorted_ids[: int(post)]
    assert sorted(used[used < p].tolist()) == list(range(p))  # every pair exactly once
    assert (sorted_ids[int(post) :] == p).all()
    for b, e in enumerate(expert_ids[: int(post) // block_m].tolist()):
        blk = sorted_ids[b * block_m : (b + 1) * block_m]
        real = blk[blk < p]
        assert len(real) and (flat[real] == e).all()  # a block holds one expert's pairs, in pair order
        assert real.tolist() == sorted(real.tolist())
    counts = torch.bincount(flat, minlength=6)
    assert int(post) == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_hf(renormalize: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 32)
    _, hf_weights, hf_ids = router(x)
    weights, ids = moe.select_experts(F.linear(x, router.weight), 2, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, rtol=1e-6)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_custom_routing_function_routes_the_layer(kernel: str) -> None:
    """FusedMoE(custom_routing_function=f) weights each token's experts as f gives them (here the two lowest
    logits, weighted 1.5 and -0.5, as no softmax top-k would), and passes f its top_k and renormalize."""
    t, e, h, i = 9, 8, 32, 16
    x, w13, w2, _, _ = _problem(t, e, 2, h, i, torch.float32)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(1), device=DEV)
    seen = []

    def lowest_two(router_logits, top_k, renormalize):
        seen.append((top_k, renormalize))
        ids = router_logits.topk(top_k, dim=-1, largest=False).indices
        return torch.tensor([1.5, -0.5], device=ids.device).expand(ids.shape).contiguous(), ids

    layer = moe.FusedMoE(e, 2, h, i, renormalize=False, custom_routing_function=lowest_two).to(DEV)
    layer.w13_weight.data.copy_(w13), layer.w2_weight.data.copy_(w2)
    layer.kernel = {"triton": moe.TRITON_KERNEL, "torch": moe.TORCH_KERNEL}[kernel]
    weights, ids = lowest_two(logits, 2, False)
    assert _rel(layer(x, logits), _reference(x, w13, w2, weights, ids)) < _tol(torch.float32)
    assert seen == [(2, False)] * 2


def test_expert_ranges_split_evenly() -> None:
    assert moe.expert_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert [len(r) for r in moe.expert_ranges(10, 4)] == [3, 3, 2, 2]
    assert moe.expert_ranges(128, 1) == [range(0, 128)]


def test_kernel_choice_has_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = Platform("cpu", "cpu", 1, None, 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cands = {c.name: c for c in moe_candidates(moe.MoEContext(cpu, torch.float32))}
    assert cands["torch"].valid
    assert cands["triton"].reasons == ["needs a CUDA device (or TRITON_INTERPRET=1), have cpu"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert all(c.valid for c in moe_candidates(moe.MoEContext(cpu, torch.float32)))
    gpu = Platform("cuda", "H200", 2, (9, 0), 0)
    cands = {c.name: c for c in moe_candidates(moe.MoEContext(gpu, torch.bfloat16))}
    assert cands["triton"].valid and cands["triton"].priority > cands["torch"].priority


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_moe_at_qwen3_30b_a3b_shape(dtype: torch.dtype) -> None:
    """128 experts, top-8, hidden 2048, moe_intermediate 768: a decode batch and a prefill chunk."""
    for t in (4, 512):
        x, w13, w2, weights, ids = _problem(t, 128, 8, 2048, 768, dtype, seed=t)
        out = moe.combine(moe.expert_outputs_triton(x, w13, w2, ids), weights)
        pairs = moe.expert_outputs_torch(x.double(), w13.double(), w2.double(), ids)  # float64 throughout
        ref = (pairs.view(t, 8, -1) * weights.double()[..., None]).sum(1)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        assert _rel(out, ref.cpu()) < tol
