"""turnout bench {throughput,wide,latency,prefix,structured}: one workload on turnout and its peers, side by
side on the same prompts and weights, the first run and a repeat apart, with the workload's roofline floor
and each engine's time over it; prints a table and writes a list of records (records.py) to
benchmarks/results/<workload>/."""

from __future__ import annotations

import argparse

from turnout.bench import records
from turnout.bench.peers import BENCH_PY_PEERS, HF_ENGINES, PEERS, VLLM_SITE
from turnout.bench.random_models import RANDOM_MODELS
from turnout.errors import TurnoutError

PLOT_METRIC = {"latency": "tpot_ms", "structured": "structured_cost"}  # the others: output_tokens_per_s
SELF_COMPARED = {"prefix": "caching off", "structured": "unconstrained"}  # turnout against itself, and how


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """`turnout bench WORKLOAD`; returns the workloads' subparsers, where other workloads may register."""
    from turnout.engine_args import add_engine_args

    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("bench")
    g.add_argument("--random-model", choices=RANDOM_MODELS, help="make (once, in the turnout cache) a "
                   "random-weight bf16 checkpoint of this real shape (-fp8: HF's block-scaled FP8 of it; "
                   "-fp8-dynamic: compressed-tensors per-channel FP8)")  # fmt: skip
    g.add_argument("--peers", default="", help=f"comma-separated, run side by side: {', '.join(PEERS)}")
    g.add_argument("--peers-dir", help="nanobench.py's and vllmbench.py's folder (../shared/peers, or .peer)")
    g.add_argument(
        "--vllm-site", default=VLLM_SITE, help=f"vllm's folder, the vllm peer's PYTHONPATH ({VLLM_SITE})"
    )
    g.add_argument("--peer-timeout", type=float, default=900, help="seconds one peer may run")
    g.add_argument("--cold-cache", action="store_true", help="fresh, empty kernel caches (Triton's, FA4's)")
    g.add_argument("--out", help="a .json file or a folder (default: benchmarks/results/<workload>)")
    g.add_argument("--plot", metavar="PNG", help="draw turnout, the peers and the floor (needs matplotlib)")
    add_engine_args(common)
    bench = subparsers.add_parser("bench", help="benchmark a workload against peers, with its roofline")
    workloads_ = bench.add_subparsers(dest="workload", required=True)
    t = workloads_.add_parser("throughput", parents=[common], help="nano-vllm's bench: 256 random requests")
    _nano_vllm_requests(t)
    t.add_argument("--input", help='JSONL of {"prompt": text or token ids, "max_tokens": N} instead')
    t.add_argument("--max-tokens", type=int, default=256, help="for --input lines without max_tokens")
    t.add_argument("--peer-subset", type=int, default=64, help="requests the HF peers (and turnout) run")
    t.add_argument("--peer-output-len", type=int, default=128, help="greedy tokens per subset request")
    w = workloads_.add_parser("wide", parents=[common], help="wide decode: 1024 short prompts, long outputs")
    w.add_argument("--num-prompts", type=int, default=1024)
    w.add_argument("--min-input-len", type=int, default=16, help="prompt lengths uniform in [min, max]")
    w.add_argument("--max-input-len", type=int, default=64)
    w.add_argument("--min-output-len", type=int, default=256, help="output lengths uniform in [min, max]")
    w.add_argument("--max-output-len", type=int, default=512)
    lat = workloads_.add_parser("latency", parents=[common], help="batch-1 TPOT, and TTFT by prompt length")
    lat.add_argument("--tpot-tokens", type=int, default=256, help="decode steps timed for TPOT")
    lat.add_argument("--ttft-lens", type=lambda s: [int(x) for x in s.split(",")], metavar="N,N",
                     default=[512, 4096, 16384, 32768], help="prompt lengths for TTFT (those over "
                     "max_model_len are skipped, with a note)")  # fmt: skip
    pre = workloads_.add_parser("prefix", parents=[common], help="a shared prefix, prefix caching on vs off")
    pre.add_argument("--num-prompts", type=int, default=256)
    pre.add_argument("--prefix-len", type=int, default=2000, help="tokens every request shares")
    pre.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own")
    pre.add_argument("--output-len", type=int, default=32)
    so = workloads_.add_parser(
        "structured", parents=[common], help="nano-vllm's bench with a JSON schema on some requests vs none"
    )
    _nano_vllm_requests(so)
    so.add_argument("--json-schema", metavar="FILE", help="a JSON Schema (default: an id, tags and a text)")
    so.add_argument("--structured-output-ratio", type=_ratios, default=[1.0, 0.25], metavar="R,R", help="the "
                    "share of requests held to the schema, one run pair each (default: 1,0.25)")  # fmt: skip
    for p in (t, w, lat, pre, so):
        p.set_defaults(fn=cmd_bench)
    return workloads_


def cmd_bench(args: argparse.Namespace) -> int:
    from turnout.bench.runner import Bench

    if args.plot:
        records.pyplot()  # a missing matplotlib fails now, not after the run
    bench = Bench(args, _peers(args))
    recs, floor = getattr(bench, args.workload)()
    print(records.table(recs, records.COLUMNS[args.workload]))
    print(bench.roofline_line(recs))
    path = records.write(recs, args.out or f"benchmarks/results/{args.workload}", args.workload, bench.device)
    print(f"wrote {path}")
    if args.plot:
        records.plot(recs, PLOT_METRIC.get(args.workload, "output_tokens_per_s"), args.plot, floor)
        print(f"wrote {args.plot}")
    return 1 if bench.failed else 0


def _peers(args: argparse.Namespace) -> list[str]:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if bad := [p for p in peers if p not in PEERS]:
        raise TurnoutError(f"unknown peer {bad[0]!r}; --peers takes {', '.join(PEERS)}")
    w = args.workload
    if (against := SELF_COMPARED.get(w)) and peers:
        raise TurnoutError(f"the {w} workload compares turnout with itself ({against}); drop --peers")
    if w == "wide":
        _check_wide(args, peers)
    if w == "latency" and "hf-generate-batch" in peers:
        raise TurnoutError("hf-generate-batch has no batch-1 latency mode; use --peers hf-generate")
    for p in (p for p in peers if p in BENCH_PY_PEERS):
        whose = "its own" if p == "nano-vllm" else "nano-vllm's"
        if w == "throughput" and (
            args.input or (args.num_prompts, args.max_input_len, args.max_output_len) != (256, 1024, 1024)
        ):
            raise TurnoutError(
                f"{p} runs {whose} bench.py workload only; drop --input, --num-prompts and "
                "the length options, or the peer"
            )
        if w == "latency" and args.tpot_tokens != 256:
            raise TurnoutError(f"{p}'s TPOT is over 256 tokens; drop --tpot-tokens or the peer")
    return peers


def _check_wide(args: argparse.Namespace, peers: list[str]) -> None:
    """The wide workload's lengths form ranges, and its peers run any requests (HF's run one length)."""
    if hf := [p for p in peers if p in HF_ENGINES]:
        raise TurnoutError(
            f"{hf[0]} runs the throughput workload's subset only; wide runs beside vllm, "
            "nano-vllm, turnout-static and turnout-bf16"
        )
    for what in ("input", "output"):
        lo, hi = getattr(args, f"min_{what}_len"), getattr(args, f"max_{what}_len")
        if not 1 <= lo <= hi:
            raise TurnoutError(f"--min-{what}-len {lo} and --max-{what}-len {hi}: need 1 <= min <= max")
    if args.num_prompts < 1:
        raise TurnoutError(f"--num-prompts {args.num_prompts}: need at least 1")


def _nano_vllm_requests(p: argparse.ArgumentParser) -> None:
    """The options of nano-vllm's bench requests (workloads.throughput), for the workloads that send them."""
    p.add_argument("--num-prompts", type=int, default=256, help="the first N of nano-vllm's 256 requests")
    p.add_argument("--max-input-len", type=int, default=1024, help="prompt lengths in [min(100, N), N]")
    p.add_argument("--max-output-len", type=int, default=1024, help="output lengths in [min(100, N), N]")


def _ratios(text: str) -> list[float]:
    """R[,R...]: each a share of the requests, in (0, 1]."""
    try:
        ratios = [float(x) for x in text.split(",")]
    except ValueError:
        ratios = []
    if not ratios or not all(0 < r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated shares in (0, 1]")
    return ratios
