"""Selection that measures: `turnout tune` runs the valid candidate configurations on this machine and
records their figures, keyed by everything that can change the answer; selection reads the matching
record (find_record) and takes a measured winner only past the margin and the noise (decide).

Names are imported on first use, so registering `turnout tune` on the CLI imports no torch."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MARGIN": "rule",
    "Decision": "rule",
    "decide": "rule",
    "user_settings": "rule",
    "key_diff": "key",
    "tuning_key": "key",
    "TUNABLE": "record",
    "Lookup": "record",
    "Measured": "record",
    "TuningRecord": "record",
    "find_record": "record",
    "records_dir": "record",
    "save": "record",
    "tune": "tuner",
    "tune_if_unseen": "tuner",
    "Load": "workload",
    "load_for": "workload",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"turnout.tuning.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'turnout.tuning' has no attribute {name!r}")
