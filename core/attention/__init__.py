"""The attention-backend contract: what a backend declares, the spec and metadata it gets, and the KV
write through slot_mapping that backends whose libraries do not write the cache share."""

from turnout.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionMetadata,
    AttentionSpec,
    CudagraphSupport,
)
from turnout.attention.kv_store import store_kv, valid_rows

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionMetadata",
    "AttentionSpec",
    "CudagraphSupport",
    "store_kv",
    "valid_rows",
]
