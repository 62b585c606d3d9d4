"""The attention-backend contract: what a backend declares, the metadata it gets, the KV layout it owns."""

from turnout.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    AttentionMetadata,
    CudagraphSupport,
)

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "CudagraphSupport",
]
