"""The benchmark scripts, their suites and the documents made from their records: a package, so that the
import contracts of pyproject.toml cover it. The scripts run as programs (python benchmarks/SCRIPT.py)."""
