"""Paged attention in plain torch, for the CPU."""

from turnout import hookimpl
from turnout.attention import AttentionBackend
from turnout.platform import Platform


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    from turnout_cpu.backend import CPUAttentionBackend

    return [CPUAttentionBackend()]
