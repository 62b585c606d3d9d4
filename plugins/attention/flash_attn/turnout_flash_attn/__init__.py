"""turnout plugin: the FlashAttention backend (FA2 or FA4). Importing this module imports neither."""

from turnout import EnvVar, hookimpl
from turnout.attention import AttentionBackend
from turnout.platform import Platform
from turnout_flash_attn.backend import FlashAttnBackend

__all__ = ["FlashAttnBackend"]
ENV_VARS = [
    EnvVar("TURNOUT_FLASH_ATTN", str.strip, "", "2 or 4: allow only FlashAttention-2 or only -4"),
    EnvVar("TURNOUT_FLASH_ATTN_CUDAGRAPH", str.upper, "", "a CUDA-graph support level replacing the path's"),
]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashAttnBackend(platform)]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
