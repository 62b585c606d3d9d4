"""Measurement's facade: `turnout bench` (workloads, peers, roofline, records) and `turnout bench serve`
(serve.py), and what the scripts in benchmarks/ use, which import turnout through the public facades and
this one only (the `benchmarks` contract of pyproject.toml): random-weight checkpoints, records, roofline
ceilings, the engine's stages for timers and profilers (profiling.py: `stages`, the profiling hook), and the
GEMV that profile_step.py times against cuBLAS.

Names but the CLI's are imported on first use: `turnout --help` stays light."""

from turnout.bench.cli import add_bench_parser, cmd_bench
from turnout.bench.serve import add_bench_serve_parser

__all__ = [
    "CEILINGS",
    "COLUMNS",
    "SHAPES",
    "STAGES",
    "Shape",
    "add_bench_parser",
    "add_bench_serve_parser",
    "cmd_bench",
    "current_platform",
    "gemv",
    "make_random_model",
    "memory_reports",
    "provenance",
    "random_model_dir",
    "stages",
    "table",
    "write_tokenizer",
]

_LAZY = {  # name -> (module, its name there)
    **{n: ("turnout.bench.random_models", n) for n in ("SHAPES", "make_random_model", "random_model_dir")},
    "write_tokenizer": ("turnout.bench.random_models", "write_tokenizer"),
    **{n: ("turnout.bench.records", n) for n in ("COLUMNS", "provenance", "table")},
    "CEILINGS": ("turnout.bench.roofline", "CEILINGS"),
    "Shape": ("turnout.bench.roofline", "Shape"),
    **{n: ("turnout.bench.profiling", n) for n in ("STAGES", "stages", "memory_reports")},
    "gemv": ("turnout.layers.gemv", "gemv"),  # measured on its own
    "current_platform": ("turnout.platform", "current_platform"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)
