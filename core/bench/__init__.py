"""turnout bench: workloads, peers, roofline and result records; `turnout bench serve` (serve.py)."""

from turnout.bench.cli import add_bench_parser, cmd_bench
from turnout.bench.serve import add_bench_serve_parser

__all__ = ["add_bench_parser", "add_bench_serve_parser", "cmd_bench"]
