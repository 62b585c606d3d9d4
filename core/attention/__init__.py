"""The attention-backend contract, in three parts by lifetime: the backend (what it serves, as data), its
metadata builder (one per KV-cache group, built once a step) and its impl (one per layer); the spec (shared
and per layer) and metadata they get, the KV cache dtypes (vLLM's kv_cache_dtype names) with FP8's
quantization, and the KV write through slot_mapping that backends whose libraries do not write the cache
share."""

from turnout.attention.backend import (
    KV_CACHE_DTYPES,
    LAYER_FEATURES,
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    CudagraphSupport,
    dequantize_kv,
    kv_cache_torch_dtype,
    quantize_kv,
)
from turnout.attention.kv_store import store_kv, valid_rows

__all__ = [
    "KV_CACHE_DTYPES",
    "LAYER_FEATURES",
    "AttentionBackend",
    "AttentionContext",
    "AttentionImpl",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "CudagraphSupport",
    "dequantize_kv",
    "kv_cache_torch_dtype",
    "quantize_kv",
    "store_kv",
    "valid_rows",
]
