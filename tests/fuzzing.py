"""The hypothesis settings every fuzz test shares: the same cases every run, no deadline, no database."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same cases every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(max_examples: int) -> settings:
    """FUZZ, bounded to max_examples cases."""
    return settings(FUZZ, max_examples=max_examples)
