"""Measurement's facade: `turnout bench` (workloads, peers, roofline, records) and `turnout bench serve`
(serve.py), and what the scripts in benchmarks/ use, which import turnout through the public facades and
this one only (the `benchmarks` contract of pyproject.toml): random-weight checkpoints, records, roofline
ceilings, the engine's stages for timers and profilers (profiling.py: `stages`, the profiling hook), and the
workloads' runners.

Names but the CLI's are imported on first use: `turnout --help` stays light."""

from turnout.bench.cli import add_bench_parser, cmd_bench
from turnout.bench.serve import add_bench_serve_parser

_MODULES = {  # module -> the names imported from it on first use
    "turnout.bench.random_models": ("RANDOM_MODELS", "SHAPES", "random_model", "write_tokenizer"),
    "turnout.bench.records": ("COLUMNS", "provenance", "table"),
    "turnout.bench.roofline": ("CEILINGS", "Shape"),
    "turnout.bench.profiling": ("STAGES", "stages", "memory_reports"),
    "turnout.bench.workloads": ("run", "sync", "timed", "warm_up", "wide"),
    "turnout.platform": ("current_platform",),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
__all__ = ["add_bench_parser", "add_bench_serve_parser", "cmd_bench", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
