"""turnout tune [MODEL] [--workload throughput|latency|prefix|FILE.jsonl] [--budget SECONDS] [--json]
[--kv-cache-dtype DTYPE[,DTYPE...]]: one KV cache dtype runs as in generate; a list is measured."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from turnout.errors import TurnoutError

logger = logging.getLogger("turnout")


def add_tune_parser(subparsers: Any) -> None:
    """Register `turnout tune`, with the engine flags of generate and explain."""
    from turnout.bench.random_models import SHAPES
    from turnout.engine_args import add_engine_args

    t = subparsers.add_parser(
        "tune", help="measure the candidate configurations on this machine and record the figures"
    )
    t.add_argument("model_tag", nargs="?", metavar="MODEL", help="HF-style model folder or .gguf (= --model)")
    t.add_argument("--random-model", choices=SHAPES, help="a random-weight checkpoint in that real shape")
    t.add_argument("--workload", help="throughput, latency, prefix or FILE.jsonl (default: tune_workload)")
    t.add_argument("--budget", type=float, metavar="SECONDS", help="time to spend (default: tune_budget)")
    t.add_argument("--json", action="store_true", help="print the record and the decision as JSON")
    t.add_argument(
        "--kv-cache-dtype",
        type=lambda s: tuple(s.split(",")),
        metavar="DTYPE[,DTYPE...]",
        help="the KV cache dtype (auto, fp8, fp8_e4m3); a comma list (auto,fp8) measures each as a candidate",
    )
    add_engine_args(t, skip=("tune", "tuned", "kv_cache_dtype"))
    t.set_defaults(fn=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """Tune, then print the table, the winner, the record's path and what was skipped."""
    from turnout.engine_args import engine_config_from_args
    from turnout.tuning.rule import decide, user_settings
    from turnout.tuning.tuner import tune

    if args.model_tag and args.model and args.model_tag != args.model:
        raise TurnoutError(f"two models given ({args.model_tag} and --model {args.model}); pass one")
    args.model = args.model_tag or args.model
    if args.random_model:
        if args.model:
            raise TurnoutError(f"two models given ({args.model} and --random-model); pass one")
        from turnout.bench.random_models import random_model

        args.model = str(random_model(args.random_model))
    dtypes, args.kv_cache_dtype = args.kv_cache_dtype or (), None
    if len(dtypes) == 1:  # one dtype runs as the engine flag does
        args.kv_cache_dtype, dtypes = dtypes[0], ()
    config = engine_config_from_args(args)
    budget = config.tune_budget if args.budget is None else args.budget
    if budget <= 0:
        raise TurnoutError(f"--budget {budget}: give a positive number of seconds")
    level = logger.level
    if level == logging.INFO:  # every candidate engine's start-up lines would bury the progress bar
        logger.setLevel(logging.WARNING)
    try:
        record = tune(config, args.workload or config.tune_workload, budget, kv_cache_dtypes=dtypes)
    finally:
        logger.setLevel(level)
    decision = decide(record, user_settings(config))
    if args.json:
        doc = {**record.as_dict(), "decision": {"settings": decision.settings, "why": decision.why}}
        print(json.dumps(doc, indent=2))
    else:
        _print(record, decision)
    return 0


def _print(record: Any, decision: Any) -> None:
    from turnout.tables import print_table
    from turnout.tuning.rule import gain, pct

    print(f"workload: {record.workload}: {record.requests}; tuned in {record.tune_s:.0f} s")
    base = decision.baseline
    rows = []
    for c in record.candidates:
        vs = (
            "default"
            if c is base
            else f"{'+' if (g := gain(c, base, record.higher_is_better)) >= 0 else '-'}{pct(abs(g))}"
        )
        runs = " ".join(f"{r:,.0f}" for r in c.runs)
        rows.append([c.label, runs, f"{c.median:,.0f}", pct(c.noise), vs if base else ""])
    print_table(["candidate", "runs", f"median {record.metric}", "noise", "vs default"], rows, "  ")
    default = f"the default {base.label}" if base else "none"
    print(f"winner: {decision.winner.label if decision.winner else default} ({decision.why})")
    print(f"record: {record.path}")
    if record.skipped:
        print("skipped:")
        for s in record.skipped:
            print(f"  {s}")
