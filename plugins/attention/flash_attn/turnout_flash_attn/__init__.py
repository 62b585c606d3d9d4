"""turnout plugin: the FlashAttention backend (FA2 or FA4). Importing this module imports neither."""

from turnout import Platform, hookimpl
from turnout.attention import AttentionBackend
from turnout_flash_attn.backend import FlashAttnBackend

__all__ = ["FlashAttnBackend"]


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [FlashAttnBackend(platform)]
