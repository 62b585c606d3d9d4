"""Measurement code is at most 15% of turnout's Python: the lines of benchmarks/*.py and core/bench/*.py
over those of every tracked .py file outside tests/, as `git ls-files '*.py' | grep -v '^tests/' | xargs
wc -l` counts them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENT = ("benchmarks/", "core/bench/")  # the scripts, their suites and reports; `turnout bench`
LIMIT = 0.15


def non_test_python() -> dict[str, int]:
    """Lines (newlines, as wc -l counts them) of each tracked .py file outside tests/."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    paths = [p for p in listed if not p.startswith("tests/") and (ROOT / p).is_file()]
    return {p: (ROOT / p).read_bytes().count(b"\n") for p in paths}


def test_measurement_is_at_most_15_percent_of_the_non_test_python():
    lines = non_test_python()
    ours = {p: n for p, n in lines.items() if p.startswith(MEASUREMENT)}
    share = sum(ours.values()) / sum(lines.values())
    largest = sorted(ours.items(), key=lambda kv: -kv[1])[:5]
    assert share <= LIMIT, f"{sum(ours.values())} of {sum(lines.values())} lines ({share:.1%}); {largest}"
