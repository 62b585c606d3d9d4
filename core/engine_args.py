"""The engine flags every CLI shares (vLLM's engine/arg_utils.py): one --flag per EngineConfig field, and
the EngineConfig those flags build. `turnout generate`, `serve`, `explain`, `tune`, `bench` and
`bench serve` all take their engine flags from here, so one field is one flag everywhere."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from turnout.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add --config and one --flag per EngineConfig field (but those named in skip) to p, in one group.

    An unset flag stays None, so the lower-precedence sources (defaults < config file < env) win; a bool
    field is --x/--no-x, an int, float or int-list field is parsed as one, a Literal field lists choices."""
    g = p.add_argument_group("engine (EngineConfig fields; see docs/architecture.md)")
    g.add_argument("--config", help="TOML or YAML file of EngineConfig fields")
    for name, info in EngineConfig.model_fields.items():
        if name in skip:
            continue
        flag, ann = "--" + name.replace("_", "-"), info.annotation
        args = typing.get_args(ann)
        kw: dict[str, Any] = {"default": None, "help": info.description}
        if ann is bool or ann == bool | None:
            kw["action"] = argparse.BooleanOptionalAction
        elif ann is int or (int in args and isinstance(ann, types.UnionType) and str not in args):
            kw["type"] = int
        elif ann is float:
            kw["type"] = float
        elif "list[int]" in str(ann):
            kw["type"] = lambda s: [int(x) for x in s.split(",")]
            kw["metavar"] = "N,N,..."
        elif typing.get_origin(ann) is typing.Literal:
            kw["choices"] = list(args)
        g.add_argument(flag, **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags: --config's file, then the environment, then each flag given
    (recorded with the source "flag"); a field whose flag is unset or absent from args is not overridden."""
    overrides = {k: getattr(args, k) for k in EngineConfig.model_fields if getattr(args, k, None) is not None}
    return EngineConfig.load(args.config, origin="flag", **overrides)
