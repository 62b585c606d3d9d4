"""turnout plugin: the FlashInfer attention backend. Importing this module does not import flashinfer."""

from turnout import EnvVar, Platform, hookimpl
from turnout.attention import AttentionBackend
from turnout_flashinfer.backend import FlashInferBackend
from turnout_flashinfer.envs import ENV_VARS

__all__ = ["FlashInferBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashInferBackend()]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
