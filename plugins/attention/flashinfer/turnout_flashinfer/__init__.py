"""turnout plugin: the FlashInfer attention backend. Importing this module does not import flashinfer."""

from turnout import hookimpl
from turnout.attention import AttentionBackend
from turnout.platform import Platform
from turnout_flashinfer.backend import FlashInferBackend

__all__ = ["FlashInferBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashInferBackend()]
