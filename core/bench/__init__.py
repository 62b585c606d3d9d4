"""Measurement's facade: `turnout bench` (workloads, peers, roofline, records) and `turnout bench serve`
(serve.py), and what the scripts in benchmarks/ use, which import turnout through the public facades and
this one only (the `benchmarks` contract of pyproject.toml): random-weight checkpoints, records, roofline
ceilings, the engine's stages for timers and profilers (profiling.py: `stages`, the profiling hook), and the
kernels and loaders those scripts measure on their own.

Names but the CLI's are imported on first use: `turnout --help` stays light."""

from turnout.bench.cli import add_bench_parser, cmd_bench
from turnout.bench.serve import add_bench_serve_parser

__all__ = [
    "CEILINGS",
    "SHAPES",
    "STAGES",
    "Req",
    "Shape",
    "add_bench_parser",
    "add_bench_serve_parser",
    "cmd_bench",
    "convert_gguf",
    "current_platform",
    "default_gguf_path",
    "default_model_path",
    "gemv",
    "gemv_tiles",
    "make_random_model",
    "memory_reports",
    "provenance",
    "qk_norm_rope",
    "random_config",
    "random_model_dir",
    "rms_norm",
    "silu_and_mul",
    "stages",
    "throughput",
    "write_tokenizer",
]

_LAZY = {  # name -> (module, its name there)
    **{n: ("turnout.bench.random_models", n) for n in ("SHAPES", "make_random_model", "random_config")},
    **{n: ("turnout.bench.random_models", n) for n in ("random_model_dir", "write_tokenizer")},
    "provenance": ("turnout.bench.records", "provenance"),
    "CEILINGS": ("turnout.bench.roofline", "CEILINGS"),
    "Shape": ("turnout.bench.roofline", "Shape"),
    "Req": ("turnout.bench.workloads", "Req"),
    "throughput": ("turnout.bench.workloads", "throughput"),
    **{n: ("turnout.bench.profiling", n) for n in ("STAGES", "stages", "memory_reports")},
    # measured on their own: the GEMV (its default tiles), the fused norm, rotary and activation kernels
    "gemv": ("turnout.layers.gemv", "gemv"),
    "gemv_tiles": ("turnout.layers.gemv", "tiles"),
    **{n: ("turnout.layers.fused", n) for n in ("rms_norm", "qk_norm_rope", "silu_and_mul")},
    # the embedded model's files, a GGUF's conversion, this machine
    "default_gguf_path": ("turnout.loader.default_model", "default_gguf_path"),
    "default_model_path": ("turnout.loader.default_model", "default_model_path"),
    "convert_gguf": ("turnout.loader.gguf", "convert_gguf"),
    "current_platform": ("turnout.platform", "current_platform"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)
