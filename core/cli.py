"""turnout generate | plugins | explain | serve | bench: one cmd_* function and one parser function per
subcommand."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from turnout import __version__, envs
from turnout.bench import add_bench_parser, add_bench_serve_parser
from turnout.config import EngineConfig
from turnout.engine_args import add_engine_args, engine_config_from_args
from turnout.errors import RequestError, TurnoutError
from turnout.outputs import CompletionOutput, Logprob, RequestOutput
from turnout.prompts import check_conversation, parse_prompt
from turnout.sampling_params import SamplingParams, allow_logprobs
from turnout.tables import print_table
from turnout.tuning.cli import add_tune_parser

if TYPE_CHECKING:
    from turnout.plugins import PluginManager
    from turnout.selection import Choice, Selection

logger = logging.getLogger("turnout")


def _settings(config: EngineConfig, sel: Selection) -> dict[str, dict[str, Any]]:
    """Every engine setting in effect, and where it came from: default, file, env, flag, or fitted to the
    hardware and the chosen backend (turnout.defaults) where the config left it unset."""
    out = {k: {"value": getattr(config, k), "source": config.source(k)} for k in EngineConfig.model_fields}
    for k, (value, why) in sel.fitted.items():
        out[k] = {"value": value, "source": f"fitted: {why}"}
    for k, (value, why) in _resolved(config, sel).items():
        raw = getattr(config, k)
        out[k] = {"value": value, "source": f"{config.source(k)} {'unset' if raw is None else raw}: {why}"}
    return out


def _resolved(config: EngineConfig, sel: Selection) -> dict[str, tuple[Any, str]]:
    """What the engine makes of each setting it resolves itself (left unset or "auto", or a graph mode it
    downgrades), and why."""
    info, device = sel.model_info, sel.platform.device_type
    saved = info.hf_config.get("torch_dtype") or info.hf_config.get("dtype") or "unmarked"
    dtype = _dtype_name(sel.dtype)
    kept = f"the checkpoint's {saved}" + ("" if saved == dtype else f", run in {dtype} on {device}")
    if device == "cpu" and saved == "bfloat16" != dtype:
        kept += " (no native bf16 arithmetic here)"
    out = {
        "model": (str(info.path), "the embedded SmolLM2-135M-Instruct"),
        "tokenizer": (str(config.model or info.path), "the model's own"),
        "dtype": (dtype, kept),
        "max_model_len": (
            info.max_position_embeddings,
            "the model's max_position_embeddings (lowered at start-up to what the KV cache holds, if less)",
        ),
        "moe_kernel": ("none", "a dense model") if sel.moe is None else (sel.moe.chosen.name, "selection"),
        "attention_backend": (sel.attention.chosen.name, "selection (see above)"),
        "executor": (sel.executor.chosen.name, "selection (see above)"),
    }
    out = {k: v for k, v in out.items() if getattr(config, k) in (None, "auto")}
    if (graph := sel.effective_graph.name) != config.cudagraph_mode:
        out["cudagraph_mode"] = (graph, f"downgraded, {sel.graph_note}")
    return out


def cmd_plugins(args: argparse.Namespace) -> int:
    from turnout.plugins import get_plugin_manager

    pm = get_plugin_manager()
    if args.order:
        return _print_order(pm, args.json)
    unavailable = _unavailable_here(pm)
    rows = [{**i.as_dict(), "unavailable_here": unavailable.get(i.name, [])} for i in pm.listing()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print_table(
        ["name", "distribution", "version", "status", "hooks / error"],
        [[r["name"], r["distribution"], r["version"], _plugin_status(r), r["error"] or ", ".join(r["hooks"])]
         for r in rows],
    )  # fmt: skip
    if missing := [[r["name"], why] for r in rows for why in r["unavailable_here"]]:
        print("\nunavailable on this machine, for any model:")
        print_table(["plugin", "why"], missing, "  ")
    for name in pm.unmatched_allow:
        print(f"TURNOUT_PLUGINS names '{name}', but no installed plugin has that name")
    return 0


def _print_order(pm: PluginManager, as_json: bool) -> int:
    from turnout.platform import current_platform
    from turnout.selection import attention_order

    rows = attention_order(pm, current_platform())
    if as_json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print('the order "auto" tries attention backends in: highest priority first, ties by name, then plugin;')
    print("decode: steps of decode rows (at least half the tokens); mixed: the others (mixed_priority)")
    print_table(
        ["platform", "phase", "order (priority; why it cannot run there)"],
        [[r.platform + (" (here)" if r.here else ""), r.phase, r.describe()] for r in rows],
    )
    return 0


def _plugin_status(row: dict[str, Any]) -> str:
    return f"{row['status']}; unavailable here" if row["unavailable_here"] else row["status"]


def _unavailable_here(pm: PluginManager) -> dict[str, list[str]]:
    """plugin -> why its attention backends and executors cannot run on this machine for any model: the
    device, compute capability or a library that does not import (each backend's platform_reasons), or an
    executor refusing a one-rank engine that names it; a plugin that is not a key has nothing unavailable."""
    from turnout.executor import ExecutorContext
    from turnout.platform import current_platform

    platform = current_platform()
    checks = {  # hook: (what it gives, its reasons)
        "turnout_attention_backends": ("attention backend", lambda b: b.platform_reasons(platform)),
        "turnout_executors": ("executor", lambda e: e.check(ExecutorContext(platform, 1, explicit=True))),
    }
    out: dict[str, list[str]] = {}
    for hook, (label, reasons) in checks.items():
        for res in pm.call_each(hook, platform=platform):
            why = [res.error] if res.error else []
            for item in res.value or []:
                try:
                    why += [f"{label} {item.name}: {r}" for r in reasons(item)]
                except Exception as e:  # a check that raises is a reason, as in selection
                    why.append(f"{label} {item.name}: check() raised {type(e).__name__}: {e}")
            if why:
                out.setdefault(res.plugin, []).extend(why)
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    from turnout.loader.default_model import model_info
    from turnout.selection import select_all

    config = engine_config_from_args(args)
    sel = select_all(config, model_info(config.model))  # a GGUF's own metadata: explain writes no model
    if args.json:
        print(json.dumps(_explain_doc(sel, config), indent=2))
    else:
        _print_explain(sel, config)
    return 0


def _explain_doc(sel: Selection, config: EngineConfig) -> dict[str, Any]:
    kinds = {
        c.kind: {
            "requested": c.requested,
            "chosen": c.chosen.name,
            "candidates": [{**x.as_dict(), "lost": c.why_lost(x) or None} for x in c.candidates],
        }
        for c in sel.choices
    }
    return {
        "platform": sel.platform.describe(),
        "model": str(sel.model_info.path),
        "architecture": sel.model_info.architecture,
        "dtype": _dtype_name(sel.dtype),
        "kv_cache_dtype": {
            "requested": config.kv_cache_dtype, "chosen": sel.kv_cache_dtype,
            "dtype": _dtype_name(sel.kv_cache_torch_dtype), "why": sel.kv_cache_note or None,
        },
        "kinds": kinds,
        "graph_mode": _graph_mode(sel),
        "settings": _settings(config, sel),
        "kv_cache_groups": _kv_cache_groups(sel, config),
        "attention_phases": {p: c.name for p, c in sel.attention.phases.items()} or None,
        "attention_note": sel.attention.note or None,
        "measured": _measured_doc(sel),
        **({"experts": {"kernel": sel.moe.chosen.name, **sel.experts}} if sel.moe and sel.experts else {}),
        **({"quantization": {"method": sel.quantization.chosen.name, "layers": sel.quantization_notes}}
           if sel.quantization else {}),
    }  # fmt: skip


def _kv_cache_groups(sel: Selection, config: EngineConfig) -> list[dict[str, Any]] | str:
    """Each KV-cache group: its spec kind, window and number of layers; or why they are unknown."""
    from turnout.worker.kv_cache import model_kv_cache_config

    try:
        groups = model_kv_cache_config(config, sel).groups
    except Exception as e:  # a model that cannot be built on the meta device: say so, explain goes on
        arch = sel.model_info.architecture
        return f"unknown: building {arch} on the meta device raised {type(e).__name__}: {e}"
    window = lambda s: getattr(s, "sliding_window", None)  # noqa: E731
    return [
        {"kind": g.spec.kind, "sliding_window": window(g.spec), "num_layers": len(g.layer_ids)}
        for g in groups
    ]


def _measured_doc(sel: Selection) -> dict[str, Any] | None:
    """The measured tier: the record read, each candidate's figures, and the decision."""
    m = sel.measured
    if m is None:
        return None
    doc: dict[str, Any] = {"state": m.state, "summary": m.describe(), "reasons": m.reasons}
    if m.record is not None:
        r = m.record
        doc["record"] = str(r.path) if r.path else None
        doc["metric"] = r.metric
        doc["candidates"] = [{"label": c.label, "settings": c.settings, "runs": c.runs} for c in r.candidates]
        doc["winner"] = m.decision.winner.label if m.decision.winner else None
    return doc


def _print_measured(sel: Selection) -> None:
    m = sel.measured
    if m is None:
        return
    print(f"\nmeasured tier: {m.describe()}")
    if m.record is None:
        return
    r, d = m.record, m.decision
    print(f"  record: {r.path} ({r.workload} workload, {r.metric}, higher is better: {r.higher_is_better})")
    base = d.baseline.median if d.baseline else None
    rows = []
    for c in r.candidates:
        vs = f"{(c.median / base - 1) * 100:+.1f}%" if base else ""
        mark = "*" if d.winner is c or (not d.settings and d.baseline is c) else ""
        runs = ", ".join(f"{x:,.1f}" for x in c.runs)
        rows.append([c.label, f"{c.median:,.1f}", runs, vs, mark])
    print_table(["candidate", "median", "runs", "vs default", "chosen"], rows, "  ")


def _graph_mode(sel: Selection) -> dict[str, str | None]:
    requested, effective = sel.graph.chosen.name, sel.effective_graph.name
    return {"requested": requested, "effective": effective, "reason": sel.graph_note}


def _print_explain(sel: Selection, config: EngineConfig) -> None:
    from turnout.selection import KIND_LABELS

    print(f"platform: {sel.platform.describe()}")
    print(f"model:    {sel.model_info.path} ({sel.model_info.architecture}, {_dtype_name(sel.dtype)})")
    print(f"KV cache: {sel.kv_cache_description()}")
    print(f"KV-cache groups: {_groups_line(_kv_cache_groups(sel, config))}")
    header = ["candidate", "plugin", "priority", "valid", "chosen", "why not chosen"]
    for c in sel.choices:
        print(f"\n{KIND_LABELS[c.kind]} (requested: {c.requested})")
        print_table(header, _choice_rows(c), indent="  ")
    for phase, half in sel.attention.phases.items():
        print(f"  {phase} steps: {half.name} ({half.plugin})")
    if sel.attention.note:
        print(f"  {sel.attention.note}")
    graph = _graph_mode(sel)
    print(f"\ngraph mode: requested {graph['requested']}, effective {graph['effective']}")
    if graph["reason"]:
        print(f"  downgraded: {graph['reason']}")
    if sel.moe and (experts := sel.experts):
        n, k = experts["num_experts"], experts["top_k"]
        print(f"\nexperts: {n} a MoE layer, top-{k}, kernel {sel.moe.chosen.name}")
        print(f"  {experts['layout']}")
        for rank, (start, stop) in enumerate(experts["experts_per_rank"] if experts["ep_size"] > 1 else []):
            print(f"  rank {rank}: experts {start}-{stop - 1} ({stop - start})")
    if sel.quantization:
        print(f"\nquantization {sel.quantization.chosen.name}:")
        for note in sel.quantization_notes:
            print(f"  {note}")
    _print_measured(sel)
    print("\nengine settings")
    rows = [[k, str(v["value"]), v["source"]] for k, v in _settings(config, sel).items()]
    print_table(["setting", "value", "source"], rows, "  ")


def _groups_line(groups: list[dict[str, Any]] | str) -> str:
    """The KV-cache groups in one line: "sliding_window 1024 (1 layers); full (1 layers)"."""
    if isinstance(groups, str):
        return groups
    words = lambda g: g["kind"] + (f" {g['sliding_window']}" if g["sliding_window"] else "")  # noqa: E731
    return "; ".join(f"{words(g)} ({g['num_layers']} layers)" for g in groups)


def _choice_rows(c: Choice) -> list[list[str]]:
    """Valid candidates first, in the order selection ranks them; each with its reasons or why it lost."""
    from turnout.selection import ranked

    rows = []
    for x in sorted(ranked(c.candidates), key=lambda x: not x.valid):
        why = c.why_lost(x) if x.valid else "; ".join(x.reasons)
        valid, chosen = "yes" if x.valid else "no", "*" if x.chosen else ""
        rows.append([x.name, x.plugin, str(x.priority), valid, chosen, why])
    return rows


# ---- generate ----
EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = {EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED}
EXIT_HELP = """exit codes:
  0    every prompt was answered
  1    some prompts failed: each has an output row with "error" set; the other prompts were answered
  2    bad usage, flag value, config, model or input file: nothing was generated
  3    internal error (a bug: please report it; TURNOUT_LOG_LEVEL=DEBUG shows the traceback)
  130  interrupted"""
# generate's sampling defaults that differ from SamplingParams(): greedy and longer answers
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}
ROW_KEYS = ("id", "prompt", "messages")  # the other keys a JSONL row may hold are SamplingParams fields
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
DEMO_ROW = {"messages": [{"role": "user", "content": "Write a haiku about railway switches."}]}


@dataclass
class Row:
    """One prompt of the input, and what became of it."""

    id: Any
    where: str  # "line 3" / "prompt 1": named in its error
    echo: dict[str, Any] = field(default_factory=dict)  # the input's "prompt" or "messages"
    prompt: str | list[int] | None = None  # what the engine takes
    messages: list[dict[str, str]] | None = None  # to be written by the chat template
    params: SamplingParams | None = None
    error: str | None = None  # "line 3: <problem>", as the output row's "error" holds it
    problem: str | None = None
    output: RequestOutput | None = None

    def fail(self, message: str) -> Row:
        self.error, self.problem = f"{self.where}: {message}", message
        return self

    @property
    def done(self) -> bool:
        return self.error is not None or self.output is not None


def _sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams fields from the flags, over generate's defaults; a JSONL row's keys go over these."""
    given = {f: getattr(args, "sampling_seed" if f == "seed" else f) for f in SamplingParams.field_names()}
    return {**CLI_SAMPLING_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}


def _parse_row(row: Row, obj: Any, defaults: dict[str, Any], chat: bool) -> Row:
    if not isinstance(obj, dict):
        return row.fail(f'must be a JSON object with "prompt" or "messages", got {type(obj).__name__}')
    if "id" in obj:
        if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
            return row.fail(f'"id" must be a string or an integer, got {obj["id"]!r}')
        row.id = obj["id"]
    if unknown := sorted(set(obj) - set(ROW_KEYS) - set(SamplingParams.field_names())):
        fields_ = ", ".join(SamplingParams.field_names())
        return row.fail(
            f"unknown key {unknown[0]!r}; a row holds prompt or messages, id, and any of {fields_}"
        )
    if ("prompt" in obj) == ("messages" in obj):
        return row.fail('needs exactly one of "prompt" (text or token ids) and "messages" (a chat)')
    key = "prompt" if "prompt" in obj else "messages"
    row.echo = {key: obj[key]}
    try:
        row.params = SamplingParams(**{**defaults, **{k: v for k, v in obj.items() if k not in ROW_KEYS}})
        if key == "messages":
            row.messages = check_conversation(obj["messages"])
            return row
        if isinstance(obj["prompt"], dict):
            return row.fail('"prompt" must be text or a list of token ids, got an object')
        _, row.prompt = parse_prompt(obj["prompt"])
    except RequestError as e:
        return row.fail(str(e))
    if chat and not isinstance(row.prompt, str):
        return row.fail("a token-id prompt cannot take the chat template; give text, or drop --chat")
    if chat:
        row.messages, row.prompt = [{"role": "user", "content": row.prompt}], None
    return row


def _read_rows(path: str, defaults: dict[str, Any], chat: bool) -> list[Row]:
    """One row per non-blank line; a line that is not a good row becomes an error row, the rest run."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TurnoutError(f"cannot read --input {path}: {e.strerror or e}") from None
    rows = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        row = Row(len(rows), f"line {n}")
        rows.append(row)
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            row.fail("is not UTF-8 text")
            continue
        except (ValueError, RecursionError) as e:
            row.fail(f"is not JSON ({getattr(e, 'msg', 'nested too deeply')}); write one object per line")
            continue
        _parse_row(row, obj, defaults, chat)
    return rows


def _input_rows(args: argparse.Namespace, defaults: dict[str, Any]) -> list[Row]:
    if args.input and args.prompt:
        raise TurnoutError("pass prompts with --prompt or in an --input file, not both")
    if args.input:
        return _read_rows(args.input, defaults, args.chat)
    objs = [{"prompt": p} for p in args.prompt] if args.prompt else [DEMO_ROW]
    return [_parse_row(Row(i, f"prompt {i}"), o, defaults, args.chat) for i, o in enumerate(objs)]


def _answer(llm: Any, rows: list[Row], sink: _Sink | None) -> None:
    """Each row checked alone (a bad one gets its error, the others run), then all of them in one batch;
    the sink writes each row as it finishes."""
    for r in rows:
        if r.error is None:
            try:
                if r.messages is not None:
                    _, r.prompt = llm.chat_prompt(r.messages)
                r.prompt = llm.engine.check_request(r.prompt, r.params)[0]
            except RequestError as e:
                r.fail(str(e))
    todo = [r for r in rows if r.error is None]

    def finished(i: int, out: RequestOutput) -> None:
        todo[i].output = out
        if sink is not None:
            sink.flush()

    if sink is not None:
        sink.flush()
    if todo:
        llm.generate([r.prompt for r in todo], [r.params for r in todo], on_output=finished)


def _stream(llm: Any, row: Row) -> int:
    if row.messages is not None:
        _, row.prompt = llm.chat_prompt(row.messages)
    for delta in llm.stream(row.prompt, row.params):
        print(delta, end="", flush=True)
    print()
    return EXIT_OK


def _logprobs_json(positions: list[dict[int, Logprob] | None]) -> list[Any]:
    return [
        None
        if d is None
        else [
            {"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in d.items()
        ]
        for d in positions
    ]


def _completion_json(c: CompletionOutput) -> dict[str, Any]:
    rec = {
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if c.logprobs is not None:
        rec |= {"cumulative_logprob": c.cumulative_logprob, "logprobs": _logprobs_json(c.logprobs)}  # type: ignore[arg-type]
    return rec


def _record(row: Row) -> dict[str, Any]:
    """The output row: id, the input's prompt or messages, then the first completion (all n in "outputs")."""
    rec = {"id": row.id, **row.echo}
    o = row.output
    if row.error is not None or o is None:
        return rec | {"text": "", "token_ids": [], "finish_reason": "error", "error": row.error}
    rec |= _completion_json(o.outputs[0])
    if len(o.outputs) > 1:
        rec["outputs"] = [{"index": c.index, **_completion_json(c)} for c in o.outputs]
    if o.prompt_logprobs is not None:
        rec["prompt_logprobs"] = _logprobs_json(o.prompt_logprobs)
    return rec


def _jsonl(rows: list[Row], args: argparse.Namespace) -> bool:
    """JSONL out: asked for, or the input is JSONL, or a row asks logprobs, which plain text cannot show."""
    logprobs = [(r.params.logprobs, r.params.prompt_logprobs) for r in rows if r.params is not None]
    return bool(args.output or args.json or args.input) or any(lp != (None, None) for lp in logprobs)


class _Sink:
    """JSONL rows in input order, each as soon as it and the rows before it are done: to stdout, or to a
    temporary file beside --output that replaces it at the end. Interrupted, the finished rows are kept
    (those after an unfinished one too, out of order); an existing file is replaced only by rows."""

    def __init__(self, rows: list[Row], path: str | None) -> None:
        self.rows, self.path, self.tmp = rows, path, None
        self.next = self.count = 0  # the first row not yet written; rows written
        self.closed = False
        self.file: Any = sys.stdout
        if path is None:
            return
        target = Path(path)
        try:
            if target.is_dir():
                raise IsADirectoryError(21, "it is a folder")
            fd, self.tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        except OSError as e:
            raise TurnoutError(f"cannot write --output {path}: {e.strerror or e}") from None
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(fd, target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~umask)
            self.file = os.fdopen(fd, "w")
        except BaseException:  # Ctrl-C here, too, leaves no temporary file
            os.unlink(self.tmp)
            raise

    def _put(self, r: Row) -> None:
        print(json.dumps(_record(r)), file=self.file, flush=True)
        self.count += 1
        if r.error is not None:  # one line each on stderr, too: where it is in the input, and its id
            tqdm.write(
                f"error: {r.where} (id {json.dumps(r.id)}): {r.problem}", file=sys.stderr
            )  # not mid-bar

    def flush(self) -> None:
        while self.next < len(self.rows) and self.rows[self.next].done:
            self._put(self.rows[self.next])
            self.next += 1

    def close(self, complete: bool) -> None:
        """complete: every row is done. Else (interrupted): the finished ones, after a gap too."""
        if self.closed:
            return
        self.flush()
        for r in self.rows[self.next :]:
            if r.done:
                self._put(r)
        self.closed = True
        if self.tmp is None:
            return
        self.file.close()
        if complete or self.count:
            os.replace(self.tmp, self.path)  # type: ignore[arg-type]
            logger.info("wrote %d results to %s", self.count, self.path)
        else:
            os.unlink(self.tmp)

    def discard(self) -> None:
        """An error before any row ran: no output, and --output as it was."""
        if not self.closed and self.tmp is not None:
            self.file.close()
            os.unlink(self.tmp)
        self.closed = True


def _write_text(rows: list[Row]) -> None:
    texts = [c.text for r in rows if r.output is not None for c in r.output.outputs]
    for r in rows:  # plain text: each answer, a blank line between answers
        if r.error is not None:
            print(f"error: {r.error}", file=sys.stderr)
            continue
        for c in r.output.outputs:  # type: ignore[union-attr]
            print(c.text, end="\n\n" if len(texts) > 1 else "\n")


def cmd_generate(args: argparse.Namespace) -> int:
    defaults = _sampling_defaults(args)
    allow_logprobs(engine_config_from_args(args).max_logprobs)
    SamplingParams(**defaults)  # a bad flag value fails before the model loads
    rows = _input_rows(args, defaults)
    import turnout.llm  # noqa: F401 - torch's imports are done before --output is touched

    sink = None
    try:
        sink = _Sink(rows, args.output) if _jsonl(rows, args) else None  # an unwritable --output fails here
        if any(r.error is None for r in rows):
            rc = _generate(args, rows, sink)
            if rc is not None:
                return rc
        if sink is not None:
            sink.close(complete=True)
        else:
            _write_text(rows)
    except KeyboardInterrupt:
        if sink is not None:
            sink.close(complete=False)
        raise
    finally:
        if sink is not None:
            sink.discard()
    return EXIT_ROWS_FAILED if any(r.error for r in rows) else EXIT_OK


def _generate(args: argparse.Namespace, rows: list[Row], sink: _Sink | None) -> int | None:
    """Run the rows; an exit code where one plain prompt was streamed, else None (rows to write)."""
    from turnout.llm import LLM

    llm = LLM(config=engine_config_from_args(args))
    try:
        one = rows[0].params if len(rows) == 1 and rows[0].error is None else None
        if one is not None and one.n == 1 and not one.best_of and sink is None:
            try:
                return _stream(llm, rows[0])  # one plain prompt: text as it comes
            except RequestError as e:
                rows[0].fail(str(e))
        else:
            _answer(llm, rows, sink)
        if hasattr(llm.engine, "stats"):
            logger.info("engine stats: %s", llm.engine.stats())
    finally:
        llm.shutdown()
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    from turnout.entrypoints.openai.api_server import run_server

    if args.model_tag and args.model and args.model_tag != args.model:
        raise TurnoutError(f"two models given ({args.model_tag} and --model {args.model}); pass one")
    args.model = args.model_tag or args.model
    config = engine_config_from_args(args)
    return run_server(args, config, lambda: _explain_of(config))


def _explain_of(config: EngineConfig) -> dict[str, Any]:
    """`turnout explain --json`'s document for config."""
    from turnout.loader.default_model import model_info
    from turnout.selection import select_all

    return _explain_doc(select_all(config, model_info(config.model)), config)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"1234\": -100}}', got {text!r}")
    return value


def _text(text: str) -> str:
    """A text flag's value; one whose bytes are not UTF-8 (held by Python as lone surrogates) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not UTF-8 text; pass UTF-8 (recode it, e.g. with iconv -f latin1 -t utf-8)"
        ) from None
    return text


def _escaped(text: str) -> str:
    """A flag value with \\n, \\t, \\r and \\\\ as typed in a shell read as the characters they name."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m[1]], _text(text))


def _token_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids as N,N,..., got {text!r}") from None


def _plugins_parser(sub: Any) -> None:
    pl = sub.add_parser("plugins", help="list installed plugins")
    pl.add_argument("--json", action="store_true")
    pl.add_argument(
        "--order",
        action="store_true",
        help='the order "auto" tries attention backends in, per platform and phase (decode, mixed steps)',
    )
    pl.set_defaults(fn=cmd_plugins)


def _explain_parser(sub: Any) -> None:
    ex = sub.add_parser("explain", help="show every candidate of every plugin kind and why one was chosen")
    ex.add_argument("--json", action="store_true")
    add_engine_args(ex)
    ex.set_defaults(fn=cmd_explain)


def _sampling_flags(g: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field (seed is --sampling-seed: --seed is the engine's, as in vLLM)."""
    s = g.add_argument_group(
        "sampling (SamplingParams fields; unset flags keep SamplingParams' defaults except temperature and "
        "max_tokens, and a JSONL row's own keys override these flags)"
    )
    bool_flag = dict(action=argparse.BooleanOptionalAction, default=None)
    s.add_argument("--n", type=int, help="completions per prompt (default 1)")
    s.add_argument(
        "--best-of", type=int, help="sample this many, return the n with the best cumulative logprob"
    )
    s.add_argument("--max-tokens", type=int, help="default 64 here (SamplingParams: 16)")
    s.add_argument("--min-tokens", type=int, help="no EOS, stop token or stop string before this many tokens")
    s.add_argument("--temperature", type=float, help="default 0 = greedy here (SamplingParams: 1.0)")
    s.add_argument("--top-p", type=float, help="default 1 (off)")
    s.add_argument("--top-k", type=int, help="default 0 (off)")
    s.add_argument("--min-p", type=float, help="default 0 (off)")
    s.add_argument(
        "--sampling-seed",
        type=int,
        help="per-request seed (SamplingParams.seed); the n samples use seed, seed+1, ...",
    )
    s.add_argument(
        "--stop",
        action="append",
        type=_escaped,
        help="stop string (repeatable; \\n, \\t, \\r and \\\\ are read as escapes, so --stop '\\n' stops "
        "at a newline); not in the text unless --include-stop-str-in-output",
    )
    s.add_argument(
        "--stop-token-ids", type=_token_ids, metavar="N,N,...", help="token ids that stop generation"
    )
    s.add_argument(
        "--include-stop-str-in-output", **bool_flag, help="keep the stop string or token in the text"
    )
    s.add_argument("--ignore-eos", **bool_flag, help="go on past EOS")
    s.add_argument("--repetition-penalty", type=float, help="default 1 (off)")
    s.add_argument("--presence-penalty", type=float, help="default 0 (off)")
    s.add_argument("--frequency-penalty", type=float, help="default 0 (off)")
    s.add_argument(
        "--logit-bias", type=_json_object, metavar="JSON", help="bias per token id, e.g. '{\"1234\": -100}'"
    )
    s.add_argument(
        "--bad-words",
        action="append",
        type=_text,
        metavar="WORD",
        help="a word never to generate (repeatable)",
    )
    s.add_argument("--logprobs", type=int, help="return the chosen token's logprob and the top N per token")
    s.add_argument("--prompt-logprobs", type=int, help="return the logprob and top N of every prompt token")
    s.add_argument(
        "--skip-special-tokens", **bool_flag, help="leave special tokens out of the text (default on)"
    )
    s.add_argument(
        "--structured-outputs",
        type=_json_object,
        metavar="JSON",
        help='hold the output to one constraint: {"json": SCHEMA}, {"regex": ...}, {"choice": [...]}, '
        '{"grammar": EBNF} or {"json_object": true}',
    )


def _generate_parser(sub: Any) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text (default: the embedded SmolLM2-135M-Instruct)",
        epilog=EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("--prompt", action="append", type=_text, help="prompt text (repeatable)")
    g.add_argument(
        "--input",
        help='JSONL file: per line {"prompt": text or token ids} or {"messages": [...]}, optionally "id" and '
        "SamplingParams keys for that row",
    )
    g.add_argument(
        "--output", help="write JSONL results here: one object per prompt, in input order (default: stdout)"
    )
    g.add_argument("--chat", action="store_true", help="wrap each text prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print JSONL results (as --output writes them)")
    _sampling_flags(g)
    add_engine_args(g)
    g.set_defaults(fn=cmd_generate)


class _Parser(argparse.ArgumentParser):
    """Every parser and subparser (they take the class of their parent): no abbreviated flags, whose
    silent guesses (--max-tok for --max-tokens) hide typos; usage errors as one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> typing.NoReturn:  # one line, not usage + error
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="turnout",
        description="LLM inference with plugin-selected backends.",
        epilog=EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"turnout {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    _plugins_parser(sub)
    _explain_parser(sub)
    _generate_parser(sub)
    _serve_parser(sub)
    add_tune_parser(sub)
    add_bench_serve_parser(add_bench_parser(sub))
    return p


def _serve_parser(sub: Any) -> None:
    from turnout.entrypoints.openai.cli_args import add_serve_args

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (default: the embedded model)")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", help="HF-style model folder (same as --model)")
    add_serve_args(s)
    add_engine_args(s)
    s.set_defaults(fn=cmd_serve)


def _redeliver_ignored_interrupt(unraisable: Any, forward: Callable[[Any], object]) -> None:
    """sys.unraisablehook: a Ctrl-C that lands in a callback whose exceptions Python only prints (an
    import lock's weakref callback, a __del__) is delivered to the main thread again, where it stops the
    command; anything else goes to `forward`. The signal is sent again a moment later, from a timer
    thread: sent inside the hook, it would be raised in the hook, and dropped again."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        main = threading.main_thread().ident
        timer = threading.Timer(0.01, signal.pthread_kill, (main, signal.SIGINT))
        timer.daemon = True
        timer.start()
    else:
        forward(unraisable)


def main(argv: Sequence[str] | None = None) -> int:
    """The `turnout` command: its exit code (EXIT_CODES); no traceback reaches the user."""
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_redeliver_ignored_interrupt, forward=hook)
    try:
        return _main(argv)
    finally:
        sys.unraisablehook = hook


def _main(argv: Sequence[str] | None) -> int:
    level = envs.LOG_LEVEL.value
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(level)
    args = build_parser().parse_args(argv)  # usage errors exit 2 here
    try:
        return args.fn(args)
    except (TurnoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout went away (`turnout plugins | head`): nobody reads the rest
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # a bug: one line, the traceback only when asked for
        if _interrupted(e):  # Ctrl-C inside an import that wraps what it catches
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        logger.debug("internal error", exc_info=True)
        print(
            f"internal error: {type(e).__name__}: {e}".splitlines()[0] + " (please report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _interrupted(e: BaseException | None) -> bool:
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__cause__ or e.__context__
    return e is not None


if __name__ == "__main__":
    sys.exit(main())
