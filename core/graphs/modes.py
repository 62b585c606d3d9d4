"""Runtime graph modes and graph policies.

A policy maps a batch (its token count, and whether it is uniform decode) to a runtime mode. The five
built-in policies follow vLLM's CUDAGraphMode: FULL_DECODE_ONLY = (FULL, NONE) and
FULL_AND_PIECEWISE = (FULL, PIECEWISE), the first member for uniform-decode batches, the second for
mixed ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from turnout.attention.backend import CudagraphSupport


class RuntimeMode(enum.Enum):
    """How one step runs: NONE eagerly; PIECEWISE as graphs of the pieces between attention calls, attention
    eager in the holes; FULL as one graph of the whole forward, attention included (vLLM's CUDAGraphMode)."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"


@dataclass(frozen=True)
class GraphPolicy:
    """A (decode, mixed) pair. Subclass and override runtime_mode for size-dependent rules."""

    name: str
    decode: RuntimeMode
    mixed: RuntimeMode
    priority: int = 0
    description: str = ""

    def runtime_mode(self, num_tokens: int, uniform_decode: bool) -> RuntimeMode:
        """The mode of a step of num_tokens tokens (before padding to a capture size): decode where every
        request runs one token (uniform_decode), else mixed. Capture asks it for every capture size too."""
        return self.decode if uniform_decode else self.mixed

    @property
    def uses_graphs(self) -> bool:
        """Either half captures graphs (is not NONE); False: nothing is captured, every step runs eagerly."""
        return self.decode is not RuntimeMode.NONE or self.mixed is not RuntimeMode.NONE


EAGER = GraphPolicy("NONE", RuntimeMode.NONE, RuntimeMode.NONE, description="eager everywhere")
"""The built-in NONE policy, and the one a run that captures nothing runs: every step eager."""


def _downgrade_pair(
    decode: RuntimeMode, mixed: RuntimeMode, support: CudagraphSupport
) -> tuple[RuntimeMode, RuntimeMode]:
    """vLLM's rules: FULL on mixed batches needs ALWAYS; FULL on decode needs at least UNIFORM_DECODE."""
    if mixed is RuntimeMode.FULL and support < CudagraphSupport.ALWAYS:
        mixed = RuntimeMode.PIECEWISE
    if decode is RuntimeMode.FULL and support == CudagraphSupport.NEVER:
        decode = RuntimeMode.NONE if mixed is RuntimeMode.NONE else RuntimeMode.PIECEWISE
    return decode, mixed


@dataclass(frozen=True)
class DowngradedPolicy(GraphPolicy):
    """A policy whose FULL modes are lowered to what the attention backend can replay."""

    inner: GraphPolicy | None = None
    support: CudagraphSupport = CudagraphSupport.ALWAYS

    def runtime_mode(self, num_tokens: int, uniform_decode: bool) -> RuntimeMode:
        assert self.inner is not None
        mode = self.inner.runtime_mode(num_tokens, uniform_decode)
        if uniform_decode:
            return _downgrade_pair(mode, self.inner.mixed, self.support)[0]
        return _downgrade_pair(RuntimeMode.NONE, mode, self.support)[1]


def _pair_name(decode: RuntimeMode, mixed: RuntimeMode) -> str:
    if decode == mixed:
        return decode.value
    if decode is RuntimeMode.FULL:
        return "FULL_DECODE_ONLY" if mixed is RuntimeMode.NONE else "FULL_AND_PIECEWISE"
    return f"{decode.value}/{mixed.value}"


def downgrade(
    policy: GraphPolicy, support: CudagraphSupport, backend: str, device_type: str, enforce_eager: bool
) -> tuple[GraphPolicy, str | None]:
    """The policy that will actually run, and why it differs from the requested one (None if it doesn't)."""
    if enforce_eager or device_type != "cuda":
        why = (
            "enforce_eager is set" if enforce_eager else f"CUDA graphs need a CUDA device, have {device_type}"
        )
        if policy.decode is RuntimeMode.NONE and policy.mixed is RuntimeMode.NONE:
            return policy, None
        return EAGER, why
    decode, mixed = _downgrade_pair(policy.decode, policy.mixed, support)
    if (decode, mixed) == (policy.decode, policy.mixed):
        return policy, None
    name = _pair_name(decode, mixed)
    why = f"attention backend {backend} supports CUDA graphs only at level {support.name}"
    return DowngradedPolicy(name, decode, mixed, inner=policy, support=support), why
