"""The measured tier: a tuning record whose key matches this machine, model and workload decides the
settings the user left unset, before any kind is selected; a user's setting always wins."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from turnout.config import EngineConfig
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.plugins import PluginManager

logger = logging.getLogger("turnout")


@dataclass
class MeasuredTier:
    """What the tuning records say for this config: the record used (if any), why others were not, and
    the decision against the static default."""

    state: str  # "off" (tuned = off), "none" (no matching record) or "used"
    reasons: list[str] = field(default_factory=list)  # why no record matched
    record: Any = None  # turnout.tuning.TuningRecord
    decision: Any = None  # turnout.tuning.Decision

    @property
    def source(self) -> str:
        """ "record <file name>", or "tuning record" for one not read from a file."""
        path = getattr(self.record, "path", None)
        return f"record {path.name}" if path else "tuning record"

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the decision sets; empty where no record decides."""
        return dict(self.decision.settings) if self.decision is not None else {}

    def fitted(self) -> dict[str, tuple[Any, str]]:
        """settings as Selection.fitted entries: (value, "measured, <source>")."""
        return {key: (value, f"measured, {self.source}") for key, value in self.settings.items()}

    def describe(self) -> str:
        """One line for explain and the start-up log."""
        if self.state == "off":
            return "off (tuned = off): tuning records are not read"
        if self.decision is None:
            return "no record used: " + "; ".join(self.reasons)
        return f"{self.decision.why} ({self.source})"


def measured_tier(
    config: EngineConfig, info: ModelInfo, platform: Platform, pm: PluginManager
) -> MeasuredTier:
    """The measured tier above the static priorities: a tuning record whose key matches this machine,
    model and workload decides the settings the user left unset; a user's setting always wins."""
    if config.tuned == "off":
        return MeasuredTier("off")
    from turnout import tuning  # the records, key and rule (turnout.tuning's lazy names), never the tuner

    key = tuning.tuning_key(config, info, platform, pm, config.tune_workload)
    lookup = tuning.find_record(key)
    if lookup.record is None:
        return MeasuredTier("none", lookup.reasons)
    return MeasuredTier("used", [], lookup.record, tuning.decide(lookup.record, tuning.user_settings(config)))


def apply_records(
    config: EngineConfig, info: ModelInfo, platform: Platform, pm: PluginManager
) -> tuple[EngineConfig, MeasuredTier]:
    """The step before every selector: config with the matching record's settings applied, and the tier
    read (measured_tier)."""
    measured = measured_tier(config, info, platform, pm)
    if measured.state == "used":
        logger.info("measured tier: %s", measured.describe())
    if measured.settings:
        config = config.model_copy(update=measured.settings)
    return config, measured
