"""turnout plugin: the Triton attention backend. Importing this module does not import triton."""

from turnout import EnvVar, Platform, hookimpl
from turnout.attention import AttentionBackend
from turnout_triton.backend import TritonAttentionBackend
from turnout_triton.envs import ENV_VARS

__all__ = ["TritonAttentionBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [TritonAttentionBackend()]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
