"""Layers for model plugins: tensor-parallel linears and embeddings, norms, rotary embedding, activation and
the Attention layer that calls the chosen backend. Each picks its own kernel for the device and batch."""

from turnout.layers.activation import SiluAndMul
from turnout.layers.attention import Attention
from turnout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from turnout.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
]
