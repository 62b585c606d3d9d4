"""Paged attention in plain torch, for the CPU."""

from turnout import Platform, hookimpl
from turnout.attention import AttentionBackend


@hookimpl
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    from turnout_cpu.backend import CPUAttentionBackend

    return [CPUAttentionBackend()]
