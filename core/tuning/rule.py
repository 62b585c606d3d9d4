"""The decision rule of the measured tier: a measured candidate replaces the static default only where it
beats the default's own measured figure by more than the margin and by more than either one's noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnout.attention.backend import KV_CACHE_ALIASES
from turnout.config import EngineConfig
from turnout.tuning.record import TUNABLE, Measured, TuningRecord

MARGIN = 0.03
MAX_NOISE = 0.25  # runs that spread wider measured a busy machine, not the candidate: no winner from them
MIN_RUNS = 2  # a candidate measured once has no noise figure, so it cannot be trusted
UNSET = {
    "kv_cache_dtype": "auto",
    "attention_backend": "auto",
    "max_num_batched_tokens": None,
    "block_size": None,
    "async_scheduling": None,
    "max_num_seqs": None,
}


@dataclass
class Decision:
    """What the measured tier changes (settings: only the fields that differ from the static default;
    empty = keep it), the candidates compared, and one line saying why."""

    settings: dict[str, Any]
    winner: Measured | None
    baseline: Measured | None
    why: str


def user_settings(config: EngineConfig) -> dict[str, Any]:
    """The TUNABLE fields the user set: a value other than auto/None, or cudagraph_mode from any source
    but the default."""
    out = {}
    for k in TUNABLE:
        v = getattr(config, k)
        if k == "kv_cache_dtype":
            v = KV_CACHE_ALIASES.get(v, v)  # fp8_e4m3 is fp8
        default = EngineConfig.model_fields[k].default
        if (v != UNSET[k]) if k in UNSET else (v != default or config.source(k) != "default"):
            out[k] = v
    return out


def gain(best: Measured, base: Measured, higher_is_better: bool) -> float:
    """How much better best's median is than base's, relative to base (0.05 = 5%)."""
    if not base.median or not best.median:
        return 0.0
    ratio = best.median / base.median if higher_is_better else base.median / best.median
    return ratio - 1


def beats(best: Measured, base: Measured, margin: float, higher_is_better: bool) -> tuple[bool, float, float]:
    """(best clears the bar, its gain, the bar = max(margin, best's noise, base's noise)); neither one's
    noise may pass MAX_NOISE."""
    g, bar = gain(best, base, higher_is_better), max(margin, best.noise, base.noise)
    return best is not base and g > bar and max(best.noise, base.noise) <= MAX_NOISE, g, bar


def rank(candidates: list[Measured], higher_is_better: bool) -> list[Measured]:
    """Best median first; equal medians in label order, so one record always ranks one way."""
    sign = -1 if higher_is_better else 1
    return sorted(candidates, key=lambda c: (sign * c.median, c.label))


def decide(record: TuningRecord, fixed: dict[str, Any]) -> Decision:
    """The measured choice for a config whose user set the TUNABLE fields in fixed: candidates that disagree
    with fixed are dropped; the baseline is the candidate equal to the record's default on the other fields
    and to fixed on these. A pure function of (record, fixed)."""
    fixed = {k: v for k, v in fixed.items() if k in TUNABLE}
    pool = [
        c
        for c in record.candidates
        if len(c.runs) >= MIN_RUNS and all(c.settings.get(k) == v for k, v in fixed.items())
    ]
    target = {**record.default, **fixed}
    base = next((c for c in pool if c.settings == target), None)
    if base is None:
        given = ", ".join(f"{k} = {v}" for k, v in fixed.items())
        what = f"the default with {given}" if given else "the default"
        return Decision({}, None, None, f"measured: no decision: no candidate measured twice is {what}")
    best = rank(pool, record.higher_is_better)[0]
    wins, g, bar = beats(best, base, record.margin, record.higher_is_better)
    unit = lambda c: f"{c.median:,.0f} {record.metric}"
    if wins:
        settings = {k: v for k, v in best.settings.items() if k not in fixed and record.default.get(k) != v}
        noise = max(best.noise, base.noise)
        why = (
            f"measured: {best.label} {unit(best)} beats the default {base.label} {unit(base)} by {pct(g)} "
            f"(> margin {pct(record.margin)}, noise {pct(noise)})"
        )
        return Decision(settings, best, base, why)
    others = [c for c in rank(pool, record.higher_is_better) if c is not base]
    if not others:
        return Decision({}, None, base, f"measured: only the default {base.label} was measured")
    runner = others[0]
    if (noisy := max(pool, key=lambda c: c.noise)).noise > MAX_NOISE:
        why = (
            f"measured: no decision: {noisy.label}'s runs spread by {pct(noisy.noise)} (over "
            f"{pct(MAX_NOISE)}), a busy machine; tune again when it is quieter"
        )
        return Decision({}, None, base, why)
    g = gain(runner, base, record.higher_is_better)
    why = (
        f"measured: no candidate beats the default {base.label} by more than {pct(bar)} "
        f"(best {runner.label} {'+' if g >= 0 else '-'}{pct(abs(g))})"
    )
    return Decision({}, None, base, why)


def pct(x: float) -> str:
    """0.03 -> "3%", 0.075 -> "7.5%"."""
    return f"{x * 100:.1f}".removesuffix(".0") + "%"
