"""Random-weight checkpoints in real model shapes: see turnout.bench.random_models."""

from turnout.bench import SHAPES, make_random_model

__all__ = ["SHAPES", "make_random_model"]
