"""turnout generate | plugins | explain | serve | bench serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from turnout.config import EngineConfig
from turnout.errors import TurnoutError
from turnout.sampling_params import SamplingParams

logger = logging.getLogger("turnout")


def _engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One --flag per EngineConfig field; unset flags stay None so lower-precedence sources win."""
    g = p.add_argument_group("engine (EngineConfig fields; see docs/architecture.md)")
    g.add_argument("--config", help="TOML or YAML file of EngineConfig fields")
    for name, field in EngineConfig.model_fields.items():
        if name in skip:
            continue
        flag, ann = "--" + name.replace("_", "-"), field.annotation
        args = typing.get_args(ann)
        kw: dict[str, Any] = {"default": None, "help": field.description}
        if ann is bool:
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


def _config(args: argparse.Namespace) -> EngineConfig:
    overrides = {k: getattr(args, k) for k in EngineConfig.model_fields if getattr(args, k, None) is not None}
    return EngineConfig.load(args.config, **overrides)


def cmd_plugins(args: argparse.Namespace) -> int:
    from turnout.plugins import get_plugin_manager

    pm = get_plugin_manager()
    rows = [i.as_dict() for i in pm.listing()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _table(
        ["name", "distribution", "version", "status", "hooks / error"],
        [
            [r["name"], r["distribution"], r["version"], r["status"], r["error"] or ", ".join(r["hooks"])]
            for r in rows
        ],
    )
    for name in pm.unmatched_allow:
        print(f"TURNOUT_PLUGINS names '{name}', but no installed plugin has that name")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from turnout.engine.llm_engine import resolve_model_dir
    from turnout.models.info import ModelInfo
    from turnout.selection import select_all

    config = _config(args)
    sel = select_all(config, ModelInfo.from_dir(resolve_model_dir(config)))
    graph = {
        "requested": sel.graph.chosen.name,
        "effective": sel.effective_graph.name,
        "reason": sel.graph_note,
    }
    if args.json:
        kinds = {
            c.kind: {
                "requested": c.requested,
                "chosen": c.chosen.name,
                "candidates": [x.as_dict() for x in c.candidates],
            }
            for c in sel.choices
        }
        doc = {
            "platform": sel.platform.describe(),
            "model": str(sel.model_info.path),
            "architecture": sel.model_info.architecture,
            "dtype": _dtype_name(sel.dtype),
            "kinds": kinds,
            "graph_mode": graph,
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"platform: {sel.platform.describe()}")
    print(f"model:    {sel.model_info.path} ({sel.model_info.architecture}, {_dtype_name(sel.dtype)})")
    from turnout.selection import KIND_LABELS

    for c in sel.choices:
        print(f"\n{KIND_LABELS[c.kind]} (requested: {c.requested})")
        rows = [
            [
                x.name,
                x.plugin,
                str(x.priority),
                "yes" if x.valid else "no",
                "*" if x.chosen else "",
                "; ".join(x.reasons),
            ]
            for x in sorted(c.candidates, key=lambda x: (not x.valid, -x.priority, x.name))
        ]
        _table(["candidate", "plugin", "priority", "valid", "chosen", "reasons"], rows, indent="  ")
    print(f"\ngraph mode: requested {graph['requested']}, effective {graph['effective']}")
    if graph["reason"]:
        print(f"  downgraded: {graph['reason']}")
    return 0


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TurnoutError(f"{path}:{n} is not JSON ({e.msg}); one object per line") from None
                if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                    raise TurnoutError(f'{path}:{n} needs a "prompt" string or a "messages" list')
                rows.append(row)
    return rows


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)  # bad sampling values fail before the model loads
    rows = _read_jsonl(args.input) if args.input else [{"prompt": p} for p in args.prompt or []]
    if not rows:
        rows = [{"prompt": "Write a haiku about railway switches."}]
        args.chat = True
    from turnout.llm import LLM

    llm = LLM(config=_config(args))
    prompts = [
        llm.apply_chat_template(r["messages"])
        if "messages" in r
        else llm.apply_chat_template([{"role": "user", "content": r["prompt"]}])
        if args.chat
        else r["prompt"]
        for r in rows
    ]
    try:
        if len(prompts) == 1 and not args.json and not args.input:
            for delta in llm.stream(prompts[0], params):
                print(delta, end="", flush=True)
            print()
            return 0
        outs = llm.generate(prompts, params)
        sink = open(args.output, "w") if args.output else sys.stdout
        for row, o in zip(rows, outs):
            rec = {**row, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
            if o.error:
                rec["error"] = o.error
            print(json.dumps(rec) if (args.json or args.input) else o.text, file=sink)
        if args.output:
            sink.close()
            logger.info("wrote %d results to %s", len(outs), args.output)
        if hasattr(llm.engine, "stats"):
            logger.info("engine stats: %s", llm.engine.stats())
        return 1 if any(o.error for o in outs) else 0
    finally:
        llm.shutdown()


def cmd_serve(args: argparse.Namespace) -> int:
    from turnout.entrypoints.openai.api_server import run_server

    if args.model_tag and args.model and args.model_tag != args.model:
        raise TurnoutError(f"two models given ({args.model_tag} and --model {args.model}); pass one")
    args.model = args.model_tag or args.model
    return run_server(args, _config(args))


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _table(header: list[str], rows: list[list[str]], indent: str = "") -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, *rows]:
        print(indent + "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnout", description="LLM inference with plugin-selected backends.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plugins", help="list installed plugins")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plugins)
    ex = sub.add_parser("explain", help="show every candidate of every plugin kind and why one was chosen")
    ex.add_argument("--json", action="store_true")
    _engine_flags(ex)
    ex.set_defaults(fn=cmd_explain)
    g = sub.add_parser("generate", help="generate text (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--input", help='JSONL file of {"prompt": ...} or {"messages": [...]} objects')
    g.add_argument("--output", help="write JSONL results here (default: stdout)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _engine_flags(g, skip=("seed",))  # --seed above is the request's; the engine seed comes from config
    g.set_defaults(fn=cmd_generate)
    from turnout.entrypoints.openai.cli_args import add_serve_args

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (default: the embedded model)")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", help="HF-style model folder (same as --model)")
    add_serve_args(s)
    _engine_flags(s)
    s.set_defaults(fn=cmd_serve)
    from turnout.entrypoints.bench_serve import add_bench_serve_parser

    b = sub.add_parser("bench", help="benchmarks")
    add_bench_serve_parser(b.add_subparsers(dest="bench_cmd", required=True))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    level = os.environ.get("TURNOUT_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(level)
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (TurnoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
