"""turnout bench: workloads, peers, roofline and result records."""

from turnout.bench.cli import add_bench_parser, cmd_bench

__all__ = ["add_bench_parser", "cmd_bench"]
