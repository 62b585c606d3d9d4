"""The rule every kind follows: each plugin's offers become candidates, each with the reasons it cannot serve;
an explicit request must be valid, and otherwise the valid candidate of the highest priority wins. Every
rejection keeps its reason, so `turnout explain` can show it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from turnout.errors import SelectionError
from turnout.plugins import PluginManager

KIND_LABELS = {  # each kind in words
    "attention": "attention backend",
    "model": "model architecture",
    "executor": "executor",
    "graph": "graph policy",
    "moe": "MoE kernel",
    "quantization": "quantization method",
}
CONFIG_KEYS = {  # what names the candidate to use
    "attention": "attention_backend",
    "model": "the checkpoint's architectures",
    "executor": "executor",
    "graph": "cudagraph_mode",
    "moe": "moe_kernel",
    "quantization": "quantization",
}


@dataclass
class Candidate:
    """One offer of one plugin: its name, its priority and why it cannot serve (empty: valid)."""

    kind: str
    name: str
    plugin: str
    priority: int
    reasons: list[str]  # why it cannot serve; empty: valid
    obj: Any = None
    chosen: bool = False

    @property
    def valid(self) -> bool:
        """No reason stands against it."""
        return not self.reasons

    @property
    def mixed_priority(self) -> int:
        """The priority for mixed and prefill steps: the backend's mixed_priority, else priority."""
        p = getattr(self.obj, "mixed_priority", None)
        return self.priority if p is None else int(p)

    def priority_for(self, phase: str) -> int:
        """The priority this candidate ranks by for phase (PHASES): "mixed" is mixed_priority, any other
        its priority."""
        return self.mixed_priority if phase == "mixed" else self.priority

    def as_dict(self) -> dict[str, Any]:
        """explain --json's row."""
        keys = ("name", "plugin", "priority", "valid", "reasons", "chosen")
        return {k: getattr(self, k) for k in keys}


PHASES = ("decode", "mixed")  # attention's: decode steps (per_phase.decode_step); the others


def ranked(candidates: Iterable[Candidate], phase: str = "decode") -> list[Candidate]:
    """candidates in the order "auto" tries them, the one rule of every kind: the highest priority for phase
    first (Candidate.priority_for; "decode" for the kinds without phases), ties by name, then by plugin."""
    return sorted(candidates, key=lambda c: (-c.priority_for(phase), c.name, c.plugin))


class Loss(enum.Enum):
    """Why a valid candidate was not chosen."""

    NOT_REQUESTED = "not requested"  # the config named another
    PRIORITY = "lower priority"
    NAME = "same priority, its name sorts after"
    PLUGIN = "same name and priority, its plugin sorts after"


@dataclass
class Choice:
    """One kind's decision: every candidate, the chosen one and, for attention per phase, each half."""

    kind: str
    requested: str
    candidates: list[Candidate]
    chosen: Candidate
    phases: dict[str, Candidate] = field(default_factory=dict)  # per-phase attention: phase -> its half
    note: str = ""  # the backends "auto" passed over for mixed steps, and why

    @property
    def obj(self) -> Any:
        """The chosen candidate's object."""
        return self.chosen.obj

    def loss(self, c: Candidate) -> Loss | None:
        """Why valid candidate c lost to the chosen one; None for the chosen, a per-phase half and invalid
        candidates."""
        w = self.chosen
        if c is w or not c.valid or c in self.phases.values():
            return None
        if c.name != self.requested and self.requested != "auto":
            return Loss.NOT_REQUESTED
        if c.priority != w.priority:
            return Loss.PRIORITY
        return Loss.NAME if c.name != w.name else Loss.PLUGIN

    def why_lost(self, c: Candidate) -> str:
        """loss(c) in words, e.g. "priority -5 < cpu 0"; empty where c did not lose."""
        w, loss = self.chosen, self.loss(c)
        if loss is None:
            phase = next((p for p, h in self.phases.items() if h is c), None)
            return f"serves the {phase} steps of {w.name}" if phase else ""
        if loss is Loss.NOT_REQUESTED:
            return f"not requested ({CONFIG_KEYS[self.kind]} = {self.requested})"
        if self.phases and self.requested == "auto":  # each phase went to the half ranked first for it
            d, m = self.phases["decode"], self.phases["mixed"]
            return (
                f"{_ranked_below('priority', c.priority, d, d.priority, c)} (decode steps); "
                f"{_ranked_below('mixed priority', c.mixed_priority, m, m.mixed_priority, c)} (mixed steps)"
            )
        return _ranked_below("priority", c.priority, w, w.priority, c)


def _ranked_below(label: str, value: int, winner: Candidate, best: int, c: Candidate) -> str:
    """Why c (value) ranks after winner (best) in words: "priority 5 < a 10", or the tie broken by name,
    then by plugin."""
    name = winner.name if winner.name != c.name else f"plugin {winner.plugin}"
    if value != best:
        return f"{label} {value} < {name} {best}"
    first = winner.name if winner.name != c.name else winner.plugin
    return f"{label} {value} = {name} {best}; '{first}' sorts first"


def choose(kind: str, candidates: list[Candidate], requested: str = "auto") -> Choice:
    """An explicit request must be valid; among the valid candidates it names, or among all valid ones
    under "auto", the highest priority wins, ties by name, then by plugin name."""
    label = KIND_LABELS[kind]
    valid = ranked(c for c in candidates if c.valid)
    options = ", ".join(dict.fromkeys(c.name for c in valid)) or "none"
    if requested != "auto":
        named = [c for c in candidates if c.name == requested]
        if not named:
            known = ", ".join(sorted({c.name for c in candidates})) or "none"
            raise SelectionError(f"unknown {label} '{requested}'; installed: {known}; valid here: {options}")
        if not any(c.valid for c in named):
            why = "; ".join(r for c in named for r in c.reasons)
            raise SelectionError(f"{label} '{requested}' cannot be used: {why}; valid here: {options}")
        valid = [c for c in valid if c.name == requested]
    if not valid:
        rejected = "; ".join(f"{c.name}: {', '.join(c.reasons)}" for c in candidates) or "none installed"
        raise SelectionError(f"no usable {label}: {rejected}; install or enable a plugin that provides one")
    valid[0].chosen = True
    return Choice(kind, requested, candidates, valid[0])


def plugin_candidates(
    pm: PluginManager, hook: str, kind: str, reasons: Callable[[str, Any], list[str]], **kwargs: Any
) -> list[Candidate]:
    """Every item every plugin returns, as a candidate with reasons(plugin, item). A plugin whose hook
    raised becomes one invalid candidate named <plugin>; a check() that raises is a reason, not a crash. What
    an incompatible plugin offers is an invalid candidate without an object, its reason the plugin's."""
    cands = []
    for res in pm.call_each(hook, **kwargs):
        if res.error:
            cands.append(Candidate(kind, f"<{res.plugin}>", res.plugin, 0, [res.error]))
            continue
        for item in res.value or []:
            try:
                why = reasons(res.plugin, item)
            except Exception as e:
                why = [f"check() raised {type(e).__name__}: {e}"]
            cands.append(Candidate(kind, item.name, res.plugin, int(item.priority), why, item))
    return cands + [Candidate(kind, n, p, 0, [why]) for n, p, why in pm.withheld_offers(hook)]
