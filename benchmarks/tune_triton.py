"""Tile sweeps for the Triton attention kernels (turnout_triton.kernels): prefill, and with --decode the
decode kernel.

On CUDA: causal prefill of 1 x 4k, 1 x 16k and 4 x 4k tokens, shaped as in bench_attention.py (bf16,
32 query / 8 KV heads, head 128, block_size 16, shuffled block table). Each config of the grid
(block_m x block_n x warps x stages, K through tl.trans) that fits is compiled, first by parallel
worker processes that fill Triton's on-disk cache, then timed here with CUDA events after an L2 flush
(median); the 3 best are timed again with K^T read straight from the cache (trans_k=1). Configs that
fail to compile or launch are skipped, and no config starts after --budget seconds. TFLOP/s counts
2 L^2 H D per request of L tokens (4 L^2 H D halved by the mask), as bench_attention.py does; the score
is the geometric mean over the cases. The best config is checked against torch SDPA in float32
(relative error < 1e-2). Use the winner with TURNOUT_TRITON_PREFILL=block_m,block_n,warps,stages,trans_k
or make it the default in _prefill_config.

--decode: decode batches of 64 and 256 requests at 512, 1024 and 2048 keys (Qwen3-0.6B heads: 16 query /
8 KV, or --heads 32,8 for Qwen3-8B's; head 128, or --head-size; bf16, block_size 16, shuffled block
table), for every
(block_n, warps, stages) of the grid, and with --maxnreg every register cap a thread (ptxas maxnreg, 0 for
the compiler's choice) as a fourth field, the current default first; each timed with CUDA events after an
L2 flush (median); the score is the geometric mean time over the cases. The sets run one after another,
not interleaved, so confirm a winner with an A/B (bench_attention.py under each setting). The best is
checked against torch SDPA in float32. Use it with TURNOUT_TRITON_DECODE=block_n,warps,stages[,maxnreg]
or make it the default in _decode_config.

  python benchmarks/tune_triton.py --json /tmp/tune.json   # suite: tune-triton
  python benchmarks/tune_triton.py --decode --json /tmp/decode.json   # suite: tune-triton
  TRITON_INTERPRET=1 python benchmarks/tune_triton.py --smoke [--decode]   # CPU: tiny shapes, checks it
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cuda_time_ms, print_table, provenance, version, write_json  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "plugins/attention/triton/turnout_triton/kernels.py"
SMEM_BYTES = 227 * 1024  # per block on an H100/H200
TOL = 1e-2


@functools.cache
def kernels() -> ModuleType:
    """This checkout's kernels.py, loaded by path (no turnout import): the file being tuned."""
    spec = importlib.util.spec_from_file_location("turnout_triton_kernels_tuned", KERNELS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_case(
    qlens: list[int], heads: tuple[int, int, int], bs: int, dtype: torch.dtype, dev: str, seed: int
):
    """q and a random paged cache of shuffled blocks for causal prefill (no cached prefix) of qlens."""
    h, kvh, d = heads
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // bs) for n in qlens]
    ids = torch.randperm(sum(nblocks), generator=g).to(torch.int32)
    table = torch.zeros(len(qlens), max(nblocks), dtype=torch.int32)
    for b, n in enumerate(nblocks):
        table[b, :n] = ids[sum(nblocks[:b]) : sum(nblocks[: b + 1])]
    kv_cache = torch.randn(2, sum(nblocks), bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(sum(qlens), h, d, generator=g).to(dtype)
    cu = torch.tensor([0, *qlens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(qlens, dtype=torch.int32)
    return dict(
        q=q.to(dev), kv_cache=kv_cache.to(dev), cu=cu.to(dev), seq_lens=seq_lens.to(dev), table=table.to(dev),
        scale=d**-0.5, qlens=qlens, flops=sum(2 * n * n * h * d for n in qlens),
    )  # fmt: skip


def run(case: dict, cfg: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    c = case
    return kernels().prefill_attention(c["q"], c["kv_cache"], c["cu"], c["seq_lens"], c["table"], c["scale"],
                                       config=cfg, out=out)  # fmt: skip


def reference(case: dict) -> torch.Tensor:
    """Causal attention of each request by torch SDPA in float32, K/V gathered through the block table."""
    q, kv, table = case["q"], case["kv_cache"], case["table"]
    _, bs, kvh, d = kv.shape[1:]
    h = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for b, n in enumerate(case["qlens"]):
        blocks = table[b, : -(-n // bs)].long()
        k, v = (kv[i, blocks].reshape(-1, kvh, d)[:n].float().repeat_interleave(h // kvh, 1) for i in (0, 1))
        qb = q[start : start + n].float()
        for h0 in range(0, h, 8):  # bounded memory even if SDPA falls back to its math kernel
            hs = slice(h0, h0 + 8)
            o = torch.nn.functional.scaled_dot_product_attention(
                qb[:, hs].transpose(0, 1), k[:, hs].transpose(0, 1), v[:, hs].transpose(0, 1),
                is_causal=True, scale=case["scale"],
            )  # fmt: skip
            out[start : start + n, hs] = o.transpose(0, 1)
        start += n
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def time_ms(fn: Callable[[], object], rep_ms: float, cuda: bool) -> float:
    """Median ms of fn. CUDA: events around each run after a 256 MB write evicts L2, as many runs as fit
    in about rep_ms (3 to 100). CPU (the interpreter): one run."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = min(100, max(3, int(rep_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    return cuda_time_ms(fn, n, warmup=0)


def _qpk_p2(heads: tuple[int, int, int]) -> int:
    """Query heads per KV head, to a power of two: the rows a KV head's tile holds per query token."""
    return 1 << max(0, math.ceil(math.log2(heads[0] // heads[1])))


def key(cfg: dict) -> str:
    return ",".join(str(int(cfg[k])) for k in ("block_m", "block_n", "warps", "stages", "trans_k"))


def grid(args: argparse.Namespace, heads: tuple[int, int, int], esz: int) -> list[dict]:
    """The configs worth compiling, most promising first: tiles that fit shared memory (K and V tiles per
    stage) and registers (the fp32 score and output tiles, at most 160 floats a thread)."""
    qpk_p2 = _qpk_p2(heads)
    hp2 = max(16, 1 << math.ceil(math.log2(heads[2])))
    out = []
    for bm, bn, w, st in itertools.product(args.block_m, args.block_n, args.warps, args.stages):
        if bm < qpk_p2 or max(st, 1) * 2 * bn * hp2 * esz > SMEM_BYTES:
            continue
        if not args.smoke and bm * (bn + hp2) > 160 * 32 * w:  # 128 x 64 on 4 warps already spills
            continue
        out.append(dict(block_m=bm, block_n=bn, warps=w, stages=st, trans_k=False))
    out.sort(key=lambda c: (abs(c["block_m"] * c["block_n"] // (c["warps"] * 32) - 64), -c["stages"]))
    return out[: args.max_configs]


# -- parallel compilation: workers launch each config once on a small case of the same specialization
# (strides, dtypes, alignment) as the timed ones, which puts the binaries in Triton's on-disk cache.


@functools.cache
def _small_case(heads: tuple[int, int, int], bs: int, dtype: str, dev: str) -> dict:
    return make_case([256, 200], heads, bs, getattr(torch, dtype), dev, seed=1)


def _compile_one(job: tuple[dict, tuple[int, int, int], int, str, str]) -> tuple[str, str | None]:
    cfg, heads, bs, dtype, dev = job
    try:
        run(_small_case(heads, bs, dtype, dev), cfg)
        if dev == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure only rules the config out
        return key(cfg), f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return key(cfg), None


def precompile(
    cfgs: list[dict], jobs: int, timeout: float, heads: tuple[int, int, int], bs: int, dtype: str, dev: str
) -> dict[str, str]:
    """{config key: error} for the configs that failed in a worker. Whatever is not done by `timeout`
    seconds is left to the timing loop (the workers are killed; what they compiled stays cached)."""
    errors: dict[str, str] = {}
    deadline = time.perf_counter() + timeout
    pool = mp.get_context("spawn").Pool(min(jobs, len(cfgs)))
    try:
        it = pool.imap_unordered(_compile_one, [(c, heads, bs, dtype, dev) for c in cfgs])
        for _ in cfgs:
            k, err = it.next(timeout=max(deadline - time.perf_counter(), 0.01))
            if err is not None:
                errors[k] = err
    except Exception as e:  # noqa: BLE001 - a timeout or a dead pool: the timing loop compiles the rest
        print(
            f"parallel compile stopped ({type(e).__name__}: {e}); the rest compiles while timing",
            file=sys.stderr,
        )
    finally:
        pool.terminate()
        pool.join()
    return errors


def measure(cfg: dict, cases: dict[str, dict], args: argparse.Namespace, cuda: bool) -> dict:
    row = dict(config=key(cfg)) | {k: cfg[k] for k in ("block_m", "block_n", "warps", "stages", "trans_k")}
    t0 = time.perf_counter()
    c = next(iter(cases.values()))
    k = kernels()._launch_prefill(c["q"], c["kv_cache"], torch.empty_like(c["q"]), c["cu"], c["seq_lens"],
                                  c["table"], c["scale"], cfg)  # fmt: skip
    meta = getattr(k, "metadata", None)
    row.update(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
               smem=getattr(meta, "shared", None))  # fmt: skip
    outs = {}
    for name, case in cases.items():
        outs[name] = torch.empty_like(case["q"])
        ms = time_ms(lambda c=case, o=outs[name]: run(c, cfg, o), args.rep, cuda)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = case["flops"] / ms / 1e9
    row["score"] = math.exp(statistics.fmean(math.log(row[f"{n}_tflops"]) for n in cases))
    row["seconds"] = time.perf_counter() - t0
    return row


def summary(failed: dict[str, str], best: str, verify: dict[str, float], use: str) -> bool:
    """A sweep's closing lines: what was skipped, the best's check against torch SDPA, how to use it.
    Returns whether the check passed."""
    if failed:
        print(f"{len(failed)} skipped: " + "; ".join(f"{k} ({v})" for k, v in list(failed.items())[:6]))
    errs = ", ".join(f"{n} {e:.1e}" for n, e in verify.items())
    ok = all(e < TOL for e in verify.values())
    print(f"best {best} vs torch SDPA (float32): relative error {errs}: {'ok' if ok else 'FAILED'}")
    print(f"use it: {use}")
    return ok


def make_decode_case(batch: int, ctx: int, heads: tuple[int, int, int], bs: int, dev: str, seed: int) -> dict:
    """One query token per request against ctx cached keys (a shuffled paged cache); no new k, v stored."""
    h, kvh, d = heads
    g = torch.Generator().manual_seed(seed)
    per = -(-ctx // bs)
    table = torch.randperm(batch * per, generator=g).to(torch.int32).view(batch, per)
    kv_cache = torch.randn(2, batch * per, bs, kvh, d, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, h, d, generator=g).to(torch.bfloat16)

    def full(v: int) -> torch.Tensor:
        return torch.full((batch,), v, dtype=torch.int32, device=dev)

    return dict(
        q=q.to(dev), kv_cache=kv_cache.to(dev), table=table.to(dev), seq_lens=full(ctx),
        slots=full(-1).long(), qsl=torch.arange(batch + 1, dtype=torch.int32, device=dev), scale=d**-0.5,
        ctx=ctx, counts=kernels().split_counts(batch * kvh, dev), splits=kernels().num_splits(ctx),
    )  # fmt: skip


def run_decode(c: dict) -> torch.Tensor:
    kv = c["q"][:, : c["kv_cache"].shape[3]]  # unread: slots are -1
    return kernels().paged_attention(c["q"], kv, kv, c["kv_cache"], c["slots"], c["qsl"], c["seq_lens"],
                                     c["table"], c["scale"], 1, c["splits"], c["counts"])  # fmt: skip


def decode_reference(c: dict) -> torch.Tensor:
    """Each request's query against all its keys, torch SDPA in float32."""
    q, kv, ctx = c["q"].float(), c["kv_cache"], c["ctx"]
    h, kvh = q.shape[1], kv.shape[3]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        k, v = (
            kv[i, c["table"][b].long()].flatten(0, 1)[:ctx].float().repeat_interleave(h // kvh, 1)
            for i in (0, 1)
        )
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b, :, None], k.transpose(0, 1), v.transpose(0, 1), scale=c["scale"]
        )
        out[b] = o[:, 0]
    return out


def _tiles(text: str) -> str:
    """A decode tile set in its short form: a register cap of 0 (none) left out."""
    return text.removesuffix(",0")


def decode_main(args: argparse.Namespace, cuda: bool) -> None:
    """--decode: the decode kernel's tile sets against the current default (see the module docstring)."""
    kn, dev = kernels(), "cuda" if cuda else "cpu"
    if args.smoke:
        heads, bs, batches, ctxs = (8, 2, 64), 16, [2], [40, 100]
        grid_ = dict(block_n=[16, 32], warps=[1], stages=[1])
    else:
        heads, bs, batches, ctxs = (*args.heads, args.head_size), 16, [64, 256], [512, 1024, 2048]
        grid_ = dict(block_n=[32, 64, 128], warps=[2, 4, 8], stages=[2, 3, 4])
    if args.maxnreg:  # a fourth field: the register cap (0: the compiler's choice)
        grid_["maxnreg"] = args.maxnreg
    sets = [
        ",".join(map(str, t)) for t in itertools.product(*(getattr(args, k) or v for k, v in grid_.items()))
    ]
    cases = {f"b{b}x{c}": make_decode_case(b, c, heads, bs, dev, seed=i)
             for i, (b, c) in enumerate(itertools.product(batches, ctxs))}  # fmt: skip
    qpk_p2 = _qpk_p2(heads)
    cfg = kn._decode_config(max(16, heads[2]), qpk_p2, False)
    default = _tiles(",".join(str(cfg[k]) for k in ("block_n", "warps", "stages", "maxnreg")))
    commit = provenance().get("commit")
    rows, failed = [], {}
    print(f"{len(sets)} tile sets and the default ({default}) x {len(cases)} cases on {dev}, heads {heads}")
    for tiles in ["", *(t for t in sets if _tiles(t) != default)]:
        kn._DECODE_OVERRIDE = tiles  # read by _decode_config at each launch
        try:
            row = {"tiles": tiles or default, "kernel_commit": commit}
            row |= {
                f"{n}_us": time_ms(lambda c=c: run_decode(c), args.rep, cuda) * 1e3 for n, c in cases.items()
            }
        except Exception as e:  # noqa: BLE001 - compile or launch failure: skip the tile set
            failed[tiles] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            continue
        row["score_us"] = math.exp(statistics.fmean(math.log(row[f"{n}_us"]) for n in cases))
        rows.append(row)
        print(f"  {row['tiles']:<10}" + "".join(f"{row[f'{n}_us']:10.1f}" for n in cases), flush=True)
    if not rows:
        sys.exit(f"tune_triton: no tile set ran; failures: {failed}")
    rows.sort(key=lambda r: r["score_us"])
    best = rows[0]["tiles"]
    kn._DECODE_OVERRIDE = best
    verify = {n: rel_err(run_decode(c), decode_reference(c)) for n, c in cases.items()}
    print_table(rows[: args.top])
    ok = summary(failed, best, verify, f"TURNOUT_TRITON_DECODE={best}")
    write_json(args.json, rows, args, workload="decode-tiles", heads=heads, block_size=bs, best=best,
               default=default, device_kind=dev, triton=version("triton"), interpret=kn.INTERPRET,
               verify_rel_err=verify, verify_ok=ok, failed=failed)  # fmt: skip
    if not ok:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and grid; runs under TRITON_INTERPRET=1")
    p.add_argument("--decode", action="store_true", help="sweep the decode kernel's tiles instead")
    p.add_argument("--maxnreg", type=_ints, default=None, help="--decode: register caps (0: none)")
    p.add_argument("--heads", type=_ints, default=[16, 8], help="--decode: query,KV heads (default 16,8)")
    p.add_argument("--head-size", type=int, default=128, help="head size of the cases (default 128)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--block-m", type=_ints, default=None, help="comma list (default 64,128)")
    p.add_argument("--block-n", type=_ints, default=None, help="comma list (default 32,64,128)")
    p.add_argument("--warps", type=_ints, default=None, help="comma list (default 4,8)")
    p.add_argument("--stages", type=_ints, default=None, help="comma list (default 1,2,3)")
    p.add_argument("--max-configs", type=int, default=40, help="cap on the grid")
    p.add_argument("--rep", type=float, default=30.0, help="ms of timed runs per case (CUDA)")
    p.add_argument("--budget", type=float, default=90.0, help="seconds after which no new config starts")
    p.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                   help="parallel compile processes (0: compile while timing)")  # fmt: skip
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not cuda and not args.smoke:
        sys.exit("tune_triton: needs a CUDA device (or --smoke under TRITON_INTERPRET=1); nothing measured")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (by kernels())
    if args.decode:
        return decode_main(args, cuda)
    start = time.perf_counter()
    kn = kernels()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    if args.smoke:
        heads, bs = (8, 2, 64), 16
        shapes = {"40": [40], "2x24": [24, 33]}
        defaults = dict(block_m=[16, 32], block_n=[16, 32], warps=[1 if not cuda else 4], stages=[1])
    else:
        heads, bs = (32, 8, args.head_size), 16
        shapes = {"4k": [4096], "16k": [16384], "4x4k": [4096] * 4}
        defaults = dict(block_m=[64, 128], block_n=[32, 64, 128], warps=[4, 8], stages=[1, 2, 3])
    for k, v in defaults.items():
        setattr(args, k, getattr(args, k) or v)
    cases = {name: make_case(q, heads, bs, dtype, dev, seed=i) for i, (name, q) in enumerate(shapes.items())}
    cfgs = grid(args, heads, dtype.itemsize)
    print(f"{len(cfgs)} configs x {len(cases)} cases ({', '.join(cases)}) on {dev}, heads {heads}, bs {bs}")

    failed: dict[str, str] = {}
    if cuda and args.jobs > 0 and len(cfgs) > 1:
        t0 = time.perf_counter()
        failed = precompile(cfgs, args.jobs, 0.6 * args.budget, heads, bs, str(dtype).split(".")[1], dev)
        print(f"compiled in {time.perf_counter() - t0:.1f}s with {args.jobs} processes; {len(failed)} failed")

    rows: list[dict] = []

    def sweep(todo: list[dict]) -> None:
        for cfg in todo:
            if key(cfg) in failed:
                continue
            if time.perf_counter() - start > args.budget:
                print(f"budget of {args.budget:.0f}s spent: {key(cfg)} and later configs skipped")
                failed[key(cfg)] = "skipped: over budget"
                continue
            try:
                rows.append(measure(cfg, cases, args, cuda))
            except Exception as e:  # noqa: BLE001 - compile or launch failure: skip the config
                failed[key(cfg)] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                continue
            r = rows[-1]
            print(f"  {r['config']:<16}" + "".join(f"{r[f'{n}_tflops']:9.1f}" for n in cases), flush=True)

    print(
        f"  {'config':<16}"
        + "".join(f"{n:>9}" for n in cases)
        + "   (TFLOP/s; config = m,n,warps,stages,K^T)"
    )
    sweep(cfgs)
    best3 = sorted(rows, key=lambda r: -r["score"])[:3]
    sweep([{k: r[k] for k in ("block_m", "block_n", "warps", "stages")} | dict(trans_k=True) for r in best3])
    if not rows:
        sys.exit(f"tune_triton: no config ran; failures: {failed}")
    rows.sort(key=lambda r: -r["score"])
    best = rows[0]
    cfg = {k: best[k] for k in ("block_m", "block_n", "warps", "stages", "trans_k")}
    verify = {}
    for name, case in cases.items():
        verify[name] = rel_err(run(case, cfg), reference(case))

    print(f"\ntop {args.top} of {len(rows)} (score: geometric mean TFLOP/s over {', '.join(cases)})")
    cols = ["config", *(f"{n}_tflops" for n in cases), "score", "regs", "spills", "smem"]
    print_table([{c: r[c] for c in cols} for r in rows[: args.top]])
    for name in cases:
        r = max(rows, key=lambda r: r[f"{name}_tflops"])
        print(f"best at {name}: {r['config']} {r[f'{name}_tflops']:.1f} TFLOP/s")
    qpk_p2 = _qpk_p2(heads)
    default = key(kn._fit_config(kn._prefill_config(max(16, heads[2]), qpk_p2, False), qpk_p2))
    for r in rows:
        if r["config"] == default:
            rates = ", ".join(f"{n} {r[f'{n}_tflops']:.1f}" for n in cases)
            print(f"current default {default}: {rates} TFLOP/s")
    use = f"TURNOUT_TRITON_PREFILL={best['config']}   ({time.perf_counter() - start:.0f}s in all)"
    ok = summary(failed, best["config"], verify, use)
    write_json(
        args.json, rows, args, heads=heads,
        block_size=bs, dtype=str(dtype), cases={n: c["qlens"] for n, c in cases.items()}, device_kind=dev,
        triton=version("triton"), interpret=kn.INTERPRET, best=best["config"], verify_rel_err=verify,
        verify_ok=ok, failed=failed,
    )  # fmt: skip
    if not ok:
        sys.exit(1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    main()
