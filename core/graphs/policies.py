"""The five built-in graph policies, registered through the same hook a third party would use."""

from __future__ import annotations

from turnout.graphs.modes import EAGER, GraphPolicy, RuntimeMode
from turnout.hookspecs import hookimpl

N, P, F = RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL  # EAGER is (N, N)

BUILTIN_POLICIES = [
    EAGER,
    GraphPolicy("PIECEWISE", P, P, description="graphs between attention calls, attention eager"),
    GraphPolicy("FULL", F, F, description="whole forward in one graph, attention included"),
    GraphPolicy("FULL_DECODE_ONLY", F, N, description="FULL for uniform decode, eager for mixed"),
    GraphPolicy("FULL_AND_PIECEWISE", F, P, description="FULL for uniform decode, PIECEWISE for mixed"),
]


@hookimpl
def turnout_graph_policies() -> list[GraphPolicy]:
    return BUILTIN_POLICIES
