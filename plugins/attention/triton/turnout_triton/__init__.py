"""turnout plugin: the Triton attention backend. Importing this module does not import triton."""

from turnout import EnvVar, hookimpl
from turnout.attention import AttentionBackend
from turnout.platform import Platform
from turnout_triton.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
ENV_VARS = [
    EnvVar("TURNOUT_TRITON_PREFILL", str, "", "prefill tiles: block_m,block_n,warps,stages[,trans_k]"),
]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [TritonAttentionBackend()]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
