"""turnout plugin: the FlashInfer attention backend. Importing this module does not import flashinfer."""

from turnout import EnvVar, hookimpl
from turnout.attention import AttentionBackend
from turnout.platform import Platform
from turnout_flashinfer.backend import FlashInferBackend

__all__ = ["FlashInferBackend"]
ENV_VARS = [
    EnvVar("TURNOUT_FLASHINFER_CUDAGRAPH", str.upper, "", "a CUDA-graph support level for FlashInfer"),
    EnvVar("TURNOUT_FLASHINFER_PREFILL_BACKEND", str, "fa2", "prefill kernels: fa2, fa3 or auto"),
]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashInferBackend()]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
