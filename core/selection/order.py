"""The order "auto" tries attention backends in, per platform and phase, as `turnout plugins --order` prints
it: each plugin's backends that declare the platform (its device type, and on CUDA no more than its compute
capability), in `ranked` order (choice.py, the one rule selection ranks by), each with why it cannot run
there for any model (a library that does not import)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnout.attention.backend import AttentionBackend
from turnout.platform import Platform
from turnout.plugins import PluginManager
from turnout.selection.choice import PHASES, Candidate, plugin_candidates, ranked

_CUDA_DTYPES = (torch.float16, torch.float32, torch.bfloat16)
REFERENCE_PLATFORMS = (  # printed beside this machine's: the CPU, Ampere and Hopper
    Platform("cpu", "cpu", 1, None, 0, (torch.float32, torch.bfloat16, torch.float16)),
    Platform("cuda", "sm80", 1, (8, 0), 0, _CUDA_DTYPES, True),
    Platform("cuda", "sm90", 1, (9, 0), 0, _CUDA_DTYPES, True),
)


def declares(backend: AttentionBackend, platform: Platform) -> bool:
    """backend declares platform's device type and, on CUDA, at most its compute capability."""
    need = backend.min_capability or (0, 0)
    return platform.device_type in backend.device_types and (platform.capability or (0, 0)) >= need


def platform_label(platform: Platform) -> str:
    """ "cpu", or "cuda sm90"."""
    cap = platform.capability
    return f"cuda sm{cap[0]}{cap[1]}" if platform.device_type == "cuda" and cap else platform.device_type


@dataclass
class PhaseOrder:
    """The attention backends offered for one platform, in the order "auto" tries them for one phase; a
    backend with reasons cannot run there for any model."""

    platform: str  # platform_label
    phase: str  # PHASES
    here: bool  # this machine's platform
    backends: list[Candidate]

    def describe(self) -> str:
        """ "triton 30 > flashinfer 20 > flash_attn 10 (not installed)"."""
        parts = []
        for c in self.backends:
            why = f" ({'; '.join(c.reasons)})" if c.reasons else ""
            parts.append(f"{c.name} {c.priority_for(self.phase)}{why}")
        return " > ".join(parts) or "none"

    def as_dict(self) -> dict:
        """One row of `turnout plugins --order --json`."""
        order = [
            {"name": c.name, "plugin": c.plugin, "priority": c.priority_for(self.phase), "reasons": c.reasons}
            for c in self.backends
        ]
        return {"platform": self.platform, "phase": self.phase, "here": self.here, "order": order}


def attention_order(pm: PluginManager, here: Platform) -> list[PhaseOrder]:
    """Per platform (REFERENCE_PLATFORMS, here in place of the one it matches or after them) and phase, the
    attention backends the plugins offer for it that declare it, ranked, each with its platform_reasons."""
    same = lambda p: (p.device_type, p.capability) == (here.device_type, here.capability)  # noqa: E731
    platforms = [here if same(p) else p for p in REFERENCE_PLATFORMS]
    platforms += [] if any(map(same, REFERENCE_PLATFORMS)) else [here]
    rows = []
    for p in platforms:
        reasons = lambda _, b, p=p: b.platform_reasons(p)  # noqa: E731
        offers = plugin_candidates(pm, "turnout_attention_backends", "attention", reasons, platform=p)
        offers = [c for c in offers if c.obj is None or declares(c.obj, p)]  # None: a plugin's error
        label = platform_label(p)
        rows += [PhaseOrder(label, phase, p is here, ranked(offers, phase)) for phase in PHASES]
    return rows
