"""The attention-backend contract: what a backend declares, the spec (shared and per layer) and metadata it
gets, and the KV write through slot_mapping that backends whose libraries do not write the cache share."""

from turnout.attention.backend import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionSpec,
    CudagraphSupport,
)
from turnout.attention.kv_store import store_kv, valid_rows

__all__ = [
    "LAYER_FEATURES",
    "AttentionBackend",
    "AttentionContext",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "AttentionSpec",
    "CudagraphSupport",
    "store_kv",
    "valid_rows",
]
