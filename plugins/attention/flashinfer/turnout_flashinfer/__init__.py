"""turnout plugin: the FlashInfer attention backend. Importing this module does not import flashinfer."""

from turnout import Platform, hookimpl
from turnout.attention import AttentionBackend
from turnout_flashinfer.backend import FlashInferBackend

__all__ = ["FlashInferBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashInferBackend()]
