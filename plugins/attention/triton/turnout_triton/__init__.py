"""turnout plugin: the Triton attention backend. Importing this module does not import triton."""

from turnout import Platform, hookimpl
from turnout.attention import AttentionBackend
from turnout_triton.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [TritonAttentionBackend()]
