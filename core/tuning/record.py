"""Tuning records: what `turnout tune` measured, kept as JSON under <cache>/tuning/, and found by key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnout.errors import TurnoutError
from turnout.tuning.key import key_diff

TUNABLE: tuple[str, ...] = (
    "kv_cache_dtype",  # searched only among the dtypes the user lists (turnout tune --kv-cache-dtype a,b)
    "attention_backend",
    "cudagraph_mode",
    "max_num_batched_tokens",
    "block_size",
    "async_scheduling",
    "max_num_seqs",
)


@dataclass
class Measured:
    """One candidate configuration (every TUNABLE field) and its figure in each measured round."""

    label: str
    settings: dict[str, Any]
    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        """The median run; 0 before any."""
        return statistics.median(self.runs) if self.runs else 0.0

    @property
    def noise(self) -> float:
        """The relative spread of the runs, (max - min) / median; 0 for fewer than two."""
        if len(self.runs) < 2 or not self.median:
            return 0.0
        return (max(self.runs) - min(self.runs)) / abs(self.median)


@dataclass
class TuningRecord:
    """A tuning run: its key, the static default it measured against, every candidate measured (in the
    order of the search) and the ones skipped, with why."""

    key: dict[str, Any]
    workload: str
    metric: str  # the unit of every run, e.g. "tok/s"
    higher_is_better: bool
    default: dict[str, Any]  # the TUNABLE settings selection picks without records
    candidates: list[Measured]
    margin: float  # the least relative gain that overrides the default
    tune_s: float
    skipped: list[str]
    created: str  # ISO 8601, UTC
    path: Path | None = None
    requests: str = ""  # what one run sends, in words

    def as_dict(self) -> dict[str, Any]:
        """Every field, JSON-able (path as a string)."""
        d = dataclasses.asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d

    def to_json(self) -> str:
        """The record as its file holds it: every field but path."""
        return json.dumps({k: v for k, v in self.as_dict().items() if k != "path"}, indent=2)

    @classmethod
    def load(cls, path: str | Path) -> TuningRecord:
        """The record in path; TurnoutError naming the file if it is not one."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
            d["candidates"] = [Measured(**c) for c in d["candidates"]]
            kv = "fp8" if d["key"].get("model", {}).get("kv_cache_dtype") else "auto"
            for settings in (d["default"], *(c.settings for c in d["candidates"])):
                settings.setdefault("kv_cache_dtype", kv)  # a record from before the KV dtype was tunable
            return cls(**{**d, "path": path})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TurnoutError(
                f"{path} is not a tuning record ({type(e).__name__}: {e}); delete it"
            ) from None


def records_dir() -> Path:
    """<turnout cache>/tuning (TURNOUT_CACHE_DIR, else ~/.cache/turnout)."""
    from turnout.loader.default_model import cache_dir

    return cache_dir() / "tuning"


def key_hash(key: dict[str, Any]) -> str:
    """12 hex digits that name a key in record file names."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def save(record: TuningRecord, directory: Path | None = None) -> Path:
    """Write record as <workload>-<key hash>-<created>.json in directory (records_dir()); sets its path."""
    directory = Path(directory or records_dir())
    directory.mkdir(parents=True, exist_ok=True)
    workload = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(record.workload).name)
    stamp = re.sub(r"[^0-9]", "", record.created.partition("+")[0])
    path = directory / f"{workload}-{key_hash(record.key)}-{stamp}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.to_json())
    tmp.replace(path)  # a reader never sees half a record
    record.path = path
    return path


@dataclass
class Lookup:
    """The record whose key matches (None if none does), and, without one, why each came close."""

    record: TuningRecord | None
    reasons: list[str]


def find_record(key: dict[str, Any], directory: Path | None = None) -> Lookup:
    """The newest record whose key equals key; otherwise no record, and the nearest one's key_diff (or
    "no tuning record in DIR"). Unreadable files are passed over, and named when nothing matches."""
    directory = Path(directory or records_dir())
    records, unreadable = [], []
    for p in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            records.append(TuningRecord.load(p))
        except TurnoutError as e:
            unreadable.append(str(e))
    records.sort(key=lambda r: (r.created, str(r.path)), reverse=True)  # newest first
    if match := next((r for r in records if r.key == key), None):
        return Lookup(match, [])
    if not records:
        return Lookup(None, [f"no tuning record in {directory}", *unreadable])
    diffs = [(key_diff(r.key, key), r) for r in records]
    diff, nearest = min(diffs, key=lambda d: len(d[0]))  # min keeps the newest of equally near ones
    return Lookup(None, [f"nearest record {nearest.path} differs: {diff[0]}", *diff[1:], *unreadable])
