"""CUDA-graph modes, the policies that pick them, the downgrade rules and the batch dispatcher."""

from turnout.graphs.modes import GraphPolicy, RuntimeMode, downgrade

__all__ = ["GraphPolicy", "RuntimeMode", "downgrade"]
