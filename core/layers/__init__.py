"""Layers for model plugins: tensor-parallel linears and embeddings, norms (RMSNorm, Gemma's GemmaRMSNorm),
rotary embedding (rope_parameters_for reads a layer type's rope from config.json), gated activations
(SiluAndMul, GeluAndMul), the Attention layer that calls the chosen backend, and FusedMoE, the experts of a
sparse MoE block (with expert parallelism). A norm or SiLU-and-mul that feeds a linear reaches it as a
PendingNorm or PendingSiluMul, which the linear computes fused with its own first kernel. Each picks its own
kernel for the device and batch; FusedMoE gets the one chosen at start-up; expert_outputs_triton computes
experts through the Triton grouped GEMM, with e4m3 weights and their scales where given; moe_align sorts
(token, expert) pairs by expert for a plugin's own grouped GEMM. pdl_launch() gives a plugin's Triton kernels
programmatic dependent launch (layers/pdl.py). add_residual, rms_norm_row, rms_norm_weighted and silu_mul
are @triton.jit row helpers for a plugin's own kernels, rounding as turnout's kernels do; they import triton
when first named.
docs/writing-a-plugin.md, "Building blocks", says what each layer computes and how it loads."""

from turnout.layers.activation import GeluAndMul, PendingSiluMul, SiluAndMul
from turnout.layers.attention import Attention
from turnout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from turnout.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from turnout.layers.moe import FusedMoE, expert_outputs_triton, moe_align, num_experts
from turnout.layers.norm import GemmaRMSNorm, PendingNorm, RMSNorm
from turnout.layers.pdl import launch as pdl_launch
from turnout.layers.rotary import RotaryEmbedding, rope_parameters_for

TRITON_HELPERS = ("add_residual", "rms_norm_row", "rms_norm_weighted", "silu_mul")  # layers/triton_kernels.py


def __getattr__(name: str) -> object:
    """The @triton.jit row helpers, from the kernels module fused.kernels() builds (importing triton)."""
    if name in TRITON_HELPERS:
        from turnout.layers import fused

        return getattr(fused.kernels(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "FusedMoE",
    "GeluAndMul",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "PendingNorm",
    "PendingSiluMul",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "add_residual",
    "expert_outputs_triton",
    "moe_align",
    "num_experts",
    "pdl_launch",
    "rms_norm_row",
    "rms_norm_weighted",
    "rope_parameters_for",
    "silu_mul",
]
