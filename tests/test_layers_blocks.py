"""The building blocks of turnout.layers against independent references: GeluAndMul against
torch.nn.functional.gelu in float64, GemmaRMSNorm against HF transformers' GemmaRMSNorm, and the behaviour
that docs/writing-a-plugin.md ("Building blocks") states for rotary, embeddings and the parallel linears."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import turnout.layers
from turnout.distributed import ParallelState, get_parallel_state, set_parallel_state
from turnout.layers import (
    GeluAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    fused,
)

GUIDE = Path(__file__).parents[1] / "docs/writing-a-plugin.md"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def tp_rank(rank: int, size: int) -> Iterator[None]:
    """Build layers as TP rank `rank` of `size` would (no process group: loaders only, no forward)."""
    prev = get_parallel_state()
    set_parallel_state(ParallelState(tp_rank=rank, tp_size=size))
    try:
        yield
    finally:
        set_parallel_state(prev)


# ---- GeluAndMul ----


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_gelu_and_mul_matches_float64_gelu(approximate: str, dtype: torch.dtype, tol: float) -> None:
    x = torch.randn(5, 3, 2 * 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    x64 = x.double()
    ref = F.gelu(x64[..., :24], approximate=approximate) * x64[..., 24:]
    out = GeluAndMul(approximate)(x)
    assert out.shape == (5, 3, 24) and out.dtype == dtype
    assert rel_err(out, ref) < tol


def test_gelu_and_mul_tanh_and_exact_differ_and_default_is_exact() -> None:
    x = torch.linspace(-4, 4, 64, dtype=torch.float64).repeat(2)
    exact, tanh = GeluAndMul()(x), GeluAndMul("tanh")(x)
    assert torch.equal(exact, F.gelu(x[:64]) * x[64:])
    assert not torch.equal(exact, tanh) and rel_err(tanh, exact) < 1e-3


def test_gelu_and_mul_matches_hf_gelu_pytorch_tanh() -> None:
    from transformers.activations import ACT2FN

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(GeluAndMul("tanh")(x), ACT2FN["gelu_pytorch_tanh"](x[:, :16]) * x[:, 16:])


def test_gelu_and_mul_rejects_an_unknown_approximation() -> None:
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        GeluAndMul("erf")


# ---- GemmaRMSNorm ----


def _hf_gemma_norm(weight: torch.Tensor, eps: float) -> torch.nn.Module:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    hf = HFGemmaRMSNorm(weight.shape[0], eps=eps)
    hf.weight.data = weight.clone()
    return hf


def _ours(weight: torch.Tensor, eps: float) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(weight.shape[0], eps)
    norm.weight.data = weight.clone()
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemma_rms_norm_is_hf_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(64, generator=g) * 0.5).to(dtype)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    out = _ours(weight, 1e-6)(x)
    assert out.dtype == dtype
    assert torch.equal(out, _hf_gemma_norm(weight, 1e-6)(x))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_gemma_rms_norm_matches_float64_with_the_unit_offset(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(3)
    weight, x = (torch.randn(32, generator=g) * 0.5).to(dtype), torch.randn(4, 3, 32, generator=g).to(dtype)
    x64, w64 = x.double(), weight.double()
    ref = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + w64)
    assert rel_err(_ours(weight, 1e-6)(x), ref) < tol


def test_gemma_rms_norm_starts_at_zero_weight_that_scales_by_one() -> None:
    norm = GemmaRMSNorm(16, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(16)) and norm.unit_offset and not RMSNorm(16).unit_offset
    x = torch.randn(3, 16)
    assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_the_residual_is_added_first_and_returned(cls: type[RMSNorm]) -> None:
    g = torch.Generator().manual_seed(4)
    norm = cls(24, 1e-5)
    norm.weight.data = torch.randn(24, generator=g)
    x, res = torch.randn(5, 24, generator=g).bfloat16(), torch.randn(5, 24, generator=g).bfloat16()
    normed, new_res = norm(x, res)
    assert torch.equal(new_res, x + res) and torch.equal(normed, norm(x + res))


def test_rms_norm_is_llamas_form() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(5)
    hf = LlamaRMSNorm(32, eps=1e-6).bfloat16()
    hf.weight.data = torch.randn(32, generator=g).bfloat16()
    ours = RMSNorm(32, 1e-6).bfloat16()
    ours.weight.data = hf.weight.data.clone()
    x = torch.randn(6, 32, generator=g).bfloat16()
    assert torch.equal(ours(x), hf(x))


def test_qk_norms_of_one_kind_take_the_fused_rope_kernel_with_their_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused q/k-norm + rope kernel applies the weight as w (RMSNorm) or as 1 + w (GemmaRMSNorm, with
    unit_offset): two norms of one kind reach it with their offset, a mixed pair keeps the torch path."""
    t, hq, hkv, d = 3, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    rope, pos = RotaryEmbedding(d, 16, 10000.0, None), torch.arange(t)
    expected = rope(pos, q, k)
    calls: list[bool] = []
    monkeypatch.setattr(fused, "enabled", lambda x: True)
    monkeypatch.setattr(
        fused, "qk_norm_rope", lambda *a, unit_offset=False: calls.append(unit_offset) or (q, k)
    )
    rope(pos, q, k, GemmaRMSNorm(d), GemmaRMSNorm(d))
    rope(pos, q, k, RMSNorm(d), RMSNorm(d))
    assert calls == [True, False]
    norms: list[bool] = []  # each norm's own kernel, here the identity: the rotation is the torch path's
    monkeypatch.setattr(fused, "rms_norm", lambda x, *a, unit_offset=False: norms.append(unit_offset) or x)
    got = rope(pos, q, k, GemmaRMSNorm(d), RMSNorm(d))
    assert calls == [True, False] and norms == [True, False]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


# ---- RotaryEmbedding ----


def test_rotary_is_rotate_half_with_float32_angles() -> None:
    d, base, t = 16, 10000.0, 5
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(t, 2, d, generator=g), torch.randn(t, 1, d, generator=g)
    pos = torch.tensor([0, 3, 7, 1, 15])
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos.double()[:, None] * inv)[:, None]  # [T, 1, D/2]
    cos, sin = ang.cos(), ang.sin()

    def ref(x: torch.Tensor) -> torch.Tensor:  # element i pairs with i + D/2
        x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    q_out, k_out = RotaryEmbedding(d, 16, base, None)(pos, q, k)
    assert rel_err(q_out, ref(q)) < 1e-6 and rel_err(k_out, ref(k)) < 1e-6


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "default", "rope_theta": 10000.0},
        {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rotary_scaling_forms_it_takes(scaling: dict | None) -> None:
    RotaryEmbedding(8, 128, 10000.0, scaling)


@pytest.mark.parametrize("kind", ["proportional", "mrope"])
def test_rotary_scaling_forms_it_refuses(kind: str) -> None:
    supported = r"\(supported: default, linear, dynamic, llama3, yarn, longrope, su\)"
    with pytest.raises(ValueError, match=f"'{kind}' is not supported {supported}"):
        RotaryEmbedding(8, 128, 10000.0, {"rope_type": kind, "factor": 2.0})


# ---- embeddings ----


def test_vocab_rows_split_ceil_with_a_zero_padded_last_rank() -> None:
    full = torch.arange(10 * 2, dtype=torch.float32).view(10, 2) + 1
    shards = []
    for r in range(4):
        with tp_rank(r, 4):
            emb = VocabParallelEmbedding(10, 2)
        emb.weight.weight_loader(emb.weight, full)
        assert emb.per_rank == 3 and emb.start == 3 * r
        shards.append(emb.weight.data)
    assert torch.equal(torch.cat(shards)[:10], full) and not shards[-1][1:].any()


def test_tied_lm_head_shares_the_embedding_parameter() -> None:
    emb, head = VocabParallelEmbedding(11, 4), ParallelLMHead(11, 4)
    head.weight = emb.weight
    e = torch.randn(11, 4)
    emb.weight.weight_loader(emb.weight, e)
    h = torch.randn(3, 4)
    assert torch.allclose(head(h), h @ e.T) and head(h).shape == (3, 11)
    assert torch.equal(emb(torch.tensor([2, 10])), e[[2, 10]])


# ---- parallel linears ----


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qkv_order_per_rank_heads_and_kv_replication(tp: int) -> None:
    hidden, d, heads, kv_heads = 3, 2, 8, 2
    g = torch.Generator().manual_seed(7)
    wq = torch.randn(heads * d, hidden, generator=g)
    wk, wv = torch.randn(kv_heads * d, hidden, generator=g), torch.randn(kv_heads * d, hidden, generator=g)
    for r in range(tp):
        with tp_rank(r, tp):
            qkv = QKVParallelLinear(hidden, d, heads, kv_heads)
        local_kv = max(1, kv_heads // tp)
        assert (qkv.num_heads, qkv.num_kv_heads) == (heads // tp, local_kv)
        assert qkv.kv_replicas == max(1, tp // kv_heads)
        for shard, w in zip("qkv", (wq, wk, wv), strict=True):
            qkv.weight.weight_loader(qkv.weight, w, shard)
        q, k, v = qkv.weight.data.split([heads // tp * d, local_kv * d, local_kv * d])
        kv_block = r // qkv.kv_replicas
        assert torch.equal(q, wq.view(tp, -1, hidden)[r])
        assert torch.equal(k, wk.view(-1, local_kv * d, hidden)[kv_block])
        assert torch.equal(v, wv.view(-1, local_kv * d, hidden)[kv_block])


def test_merged_column_holds_each_outputs_slice_in_order() -> None:
    g = torch.Generator().manual_seed(8)
    gate, up = torch.randn(4, 3, generator=g), torch.randn(6, 3, generator=g)
    for r in range(2):
        with tp_rank(r, 2):
            lin = MergedColumnParallelLinear(3, [4, 6], bias=True)
        for i, (w, b) in enumerate([(gate, gate[:, 0]), (up, up[:, 0])]):
            lin.weight.weight_loader(lin.weight, w, i)
            lin.bias.weight_loader(lin.bias, b, i)
        assert torch.equal(lin.weight.data, torch.cat([gate[2 * r : 2 * r + 2], up[3 * r : 3 * r + 3]]))
        assert torch.equal(lin.bias.data, lin.weight.data[:, 0])


def test_row_parallel_splits_columns_and_keeps_the_bias_whole() -> None:
    w, b = torch.randn(3, 8), torch.randn(3)
    for r in range(2):
        with tp_rank(r, 2):
            lin = RowParallelLinear(8, 3, bias=True)
        lin.weight.weight_loader(lin.weight, w)
        lin.bias.weight_loader(lin.bias, b)
        assert torch.equal(lin.weight.data, w[:, 4 * r : 4 * r + 4]) and torch.equal(lin.bias.data, b)


# ---- the guide ----


def test_the_guide_has_a_building_blocks_section_naming_each_layer() -> None:
    guide = GUIDE.read_text()
    section = re.search(r"^## Building blocks\n(.*?)(?=^#{1,2} )", guide, re.M | re.S)
    assert section, "docs/writing-a-plugin.md lacks its '## Building blocks' section"
    missing = [n for n in turnout.layers.__all__ if f"`{n}" not in section.group(1)]
    assert not missing, missing
