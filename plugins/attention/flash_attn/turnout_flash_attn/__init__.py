"""turnout plugin: the FlashAttention backend (FA2 or FA4). Importing this module imports neither."""

from turnout import EnvVar, Platform, hookimpl
from turnout.attention import AttentionBackend
from turnout_flash_attn.backend import FlashAttnBackend
from turnout_flash_attn.envs import ENV_VARS

__all__ = ["FlashAttnBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashAttnBackend(platform)]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
