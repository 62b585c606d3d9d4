"""Graph policies, the downgrade table, the dispatcher and padding (CPU-checkable parts of #5)."""

from __future__ import annotations

import pytest

from turnout import hookimpl
from turnout.attention import CudagraphSupport as S
from turnout.graphs.dispatcher import GraphDispatcher, default_capture_sizes
from turnout.graphs.modes import GraphPolicy, RuntimeMode, downgrade
from turnout.graphs.policies import BUILTIN_POLICIES

N, P, F = RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL
POLICY = {p.name: p for p in BUILTIN_POLICIES}

# requested mode -> effective mode name for each backend support level (vLLM's rules)
TABLE = {
    "NONE": {S.ALWAYS: "NONE", S.UNIFORM_BATCH: "NONE", S.UNIFORM_DECODE: "NONE", S.NEVER: "NONE"},
    "PIECEWISE": {S.ALWAYS: "PIECEWISE", S.UNIFORM_BATCH: "PIECEWISE", S.UNIFORM_DECODE: "PIECEWISE", S.NEVER: "PIECEWISE"},
    "FULL": {S.ALWAYS: "FULL", S.UNIFORM_BATCH: "FULL_AND_PIECEWISE", S.UNIFORM_DECODE: "FULL_AND_PIECEWISE", S.NEVER: "PIECEWISE"},
    "FULL_DECODE_ONLY": {S.ALWAYS: "FULL_DECODE_ONLY", S.UNIFORM_BATCH: "FULL_DECODE_ONLY", S.UNIFORM_DECODE: "FULL_DECODE_ONLY", S.NEVER: "NONE"},
    "FULL_AND_PIECEWISE": {S.ALWAYS: "FULL_AND_PIECEWISE", S.UNIFORM_BATCH: "FULL_AND_PIECEWISE", S.UNIFORM_DECODE: "FULL_AND_PIECEWISE", S.NEVER: "PIECEWISE"},
}  # fmt: skip


@pytest.mark.parametrize("requested", list(TABLE))
@pytest.mark.parametrize("support", list(S))
def test_downgrade_table(requested: str, support: S) -> None:
    eff, why = downgrade(POLICY[requested], support, "somebackend", "cuda", enforce_eager=False)
    assert eff.name == TABLE[requested][support]
    if eff.name == requested:
        assert why is None
    else:
        assert "somebackend" in why and support.name in why
        # the effective policy behaves as its name says, for decode and mixed batches
        want = POLICY[eff.name]
        assert eff.runtime_mode(8, True) == want.decode and eff.runtime_mode(8, False) == want.mixed


@pytest.mark.parametrize("requested", list(TABLE))
def test_cpu_and_eager_resolve_to_none(requested: str) -> None:
    eff, why = downgrade(POLICY[requested], S.ALWAYS, "b", "cpu", enforce_eager=False)
    assert eff.name == "NONE" and (requested == "NONE" or "cpu" in why)
    eff, why = downgrade(POLICY[requested], S.ALWAYS, "b", "cuda", enforce_eager=True)
    assert eff.name == "NONE" and (requested == "NONE" or "enforce_eager" in why)


def test_default_capture_sizes_follow_vllm() -> None:
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and 248 in sizes and 256 in sizes
    assert all(s % 8 == 0 for s in sizes[3:]) and all(s % 16 == 0 for s in sizes if s >= 256)
    assert 264 not in sizes and 272 in sizes
    assert default_capture_sizes(4)[-1] == 8 and default_capture_sizes(512)[-1] == 512


def test_dispatcher_pads_and_classifies() -> None:
    d = GraphDispatcher(POLICY["FULL_AND_PIECEWISE"], [1, 2, 4, 8, 16])
    assert d.dispatch([1, 1, 1]) == type(d.dispatch([1]))(F, 4, True)
    mixed = d.dispatch([5, 1, 1])
    assert (mixed.mode, mixed.num_tokens, mixed.uniform_decode) == (P, 8, False)
    big = d.dispatch([1] * 17)
    assert (big.mode, big.num_tokens) == (N, 17)  # beyond the largest size: eager, unpadded
    none = GraphDispatcher(POLICY["FULL_DECODE_ONLY"], [1, 2, 4]).dispatch([3])
    assert (none.mode, none.num_tokens) == (N, 3)


class FullUpTo64(GraphPolicy):
    def runtime_mode(self, num_tokens: int, uniform_decode: bool) -> RuntimeMode:
        return F if uniform_decode and num_tokens <= 64 else P


class _ThirdParty:
    @hookimpl
    def turnout_graph_policies(self):
        return [FullUpTo64("FULL_UPTO_64", F, P, description="FULL only up to batch 64")]


def test_third_party_policy_registers_and_dispatches(register_plugin, plugin_manager) -> None:
    from turnout.selection import choose, graph_candidates

    register_plugin(_ThirdParty(), "upto64")
    choice = choose("graph", graph_candidates(plugin_manager), "FULL_UPTO_64")
    assert choice.chosen.plugin == "upto64"
    d = GraphDispatcher(choice.obj, default_capture_sizes(256))
    assert d.dispatch([1] * 64).mode is F and d.dispatch([1] * 72).mode is P
    # downgrading wraps the custom rule: on a UNIFORM_DECODE backend mixed FULL never happens anyway,
    # on a NEVER backend decode FULL becomes PIECEWISE
    eff, why = downgrade(choice.obj, S.NEVER, "b", "cuda", False)
    assert eff.runtime_mode(8, True) is P and why
