"""Decode-sized matmuls: cuBLAS (F.linear) against turnout's Triton GEMV (core/layers/gemv.py) at the
Qwen3-0.6B shapes (or Qwen3-8B's, --shape qwen3-8b), with a sweep of the GEMV's tiles (issue #5: the
matmuls are 907 of a batch-1 step's 1306 us of kernel time on the H200).

  python benchmarks/bench_gemv.py --json /tmp/gemv.json   # suite: gemv
  TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke   # CPU: small shapes, checks the script

Each case is timed with CUDA events after an L2 flush (median of --iters) and reported as achieved
bandwidth, counting the weight, x and y bytes, against 4.3 TB/s. Every tile's output is checked against
F.linear first (max abs difference within two bf16 ulps of the output). The last lines project one
decode step's matmul time (the layers' four projections, plus the LM head) for each M: cuBLAS, and the
best tile per shape; then a summary per shape and M: the default tile's time, the best tile's, cuBLAS's,
the floor (weight bytes at 4.3 TB/s) and the best tile as a TURNOUT_GEMV_TILES entry. That variable sets
only (BLOCK_N, num_warps); BLOCK_K stays gemv.tiles()'s (the whole row up to K = 4096), so a winner with
another BLOCK_K is marked, and the entry given is the best tile with tiles()'s BLOCK_K. Use a tile with
gemv(..., tile=) or make it the default in gemv.tiles().

--prologue times qkv and gate_up with their RMSNorm (+ residual) prologue and down with SiLU-and-mul, as
the model launches them (a norm needs the whole row in one tile, so those shapes sweep no shorter
BLOCK_K); cuBLAS is still the matmul alone. Off by default, as before.

--chain times tiles where they run: one batch-1 decode step's kernels as the model launches them (per
layer: the qkv GEMV with its norm prologue, the q/k norm + rotary kernel, the o GEMV on q's rows in
place of attention, gate_up with its norm, down with SiLU-and-mul; then the LM head), each layer with
its own weights, captured in one CUDA graph with programmatic dependent launch, as a FULL graph runs
them. Isolated timings miss how a GEMV's weight reads overlap the kernel before it. Each shape's tile
is chosen in turn, the others held at their best so far (median replay time over --iters, each replay
after an L2 flush); it prints the winners as a TURNOUT_GEMV_TILES value, the step with that value's
tiles, and the same step with cuBLAS matmuls and separate norm and SiLU-and-mul kernels.

  python benchmarks/bench_gemv.py --chain --json /tmp/gemv-chain.json   # suite: gemv

--routes times, in the same captured step, each shape's matmul in cuBLAS against the Triton GEMV with and
without its prologue (the norm or SiLU-and-mul in a kernel of its own), each shape in turn from an
all-cuBLAS step, and prints the fastest routing:

  python benchmarks/bench_gemv.py --shape qwen3-8b --routes --json /tmp/gemv8b-routes.json

--shape qwen3-8b: 36 layers of hidden 4096 (qkv 6144 x 4096, o 4096 x 4096, gate_up 24576 x 4096,
down 4096 x 12288) and an untied 151936 x 4096 LM head, M = 1 and 2 by default. Its sweep tries whole-row
tiles of BLOCK_N 1-16 on 4-16 warps and, where there is no norm prologue, BLOCK_K 1024-4096 below the
row, keeping each thread's share of the [M, BLOCK_N, BLOCK_K] product at most 128 floats (64 when
looping over K; ptxas spills past that, as 8 x 4096 on 4 warps, 256 a thread, did). --layers cuts the
chain (and the step projection) to fewer layers. About a minute for each mode on an H200:

  python benchmarks/bench_gemv.py --shape qwen3-8b --prologue --json /tmp/gemv8b.json
  python benchmarks/bench_gemv.py --shape qwen3-8b --chain --json /tmp/gemv8b-chain.json
  TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke --shape qwen3-8b [--prologue | --chain]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import cuda_time_ms, print_table, write_json  # noqa: E402


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def shapes(self, layers: int | None = None) -> list[tuple[str, int, int, int]]:
        """(name, N, K, times per step) of the projections at TP=1, then the LM head."""
        per, d = layers or self.layers, self.head_dim
        return [("qkv", (self.heads + 2 * self.kv_heads) * d, self.hidden, per),
                ("o", self.hidden, self.heads * d, per),
                ("gate_up", 2 * self.intermediate, self.hidden, per),
                ("down", self.hidden, self.intermediate, per),
                ("lm_head", self.vocab, self.hidden, 1)]  # fmt: skip


MODELS = {
    "qwen3-0.6b": Model(28, 1024, 16, 8, 128, 3072, 151936),  # tied LM head
    "qwen3-8b": Model(36, 4096, 32, 8, 128, 12288, 151936),  # untied LM head
}
SMOKE_MODELS = {  # the same head ratios, small enough for the interpreter
    "qwen3-0.6b": Model(2, 64, 4, 2, 16, 96, 200),
    "qwen3-8b": Model(2, 64, 4, 1, 16, 96, 200),
}
SHAPES = MODELS["qwen3-0.6b"].shapes()  # qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072
SMOKE_SHAPES = [("small", 96, 160, 1)]
SMOKE_TILES = [(4, 64, 4), (8, 128, 2)]
NORM, SILU = ("qkv", "gate_up"), ("down",)  # the shapes whose GEMV has a norm / SiLU-and-mul prologue
BANDWIDTH = 4.3e12
EPS = 1e-6


def tile_grid(m: int) -> list[tuple[int, int, int]]:
    """The Qwen3-0.6B sweep's (BLOCK_N, BLOCK_K, num_warps) at M rows."""
    ks = [k for k in (128, 256, 512, 1024) if k * m <= 2048]  # [M_P2, BN, BK] floats in registers
    return list(itertools.product((2, 4, 8), ks, (1, 2, 4)))  # ~18 compiles per M: a minute or two in all


def chain_candidates(name: str, k: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, whole-row BLOCK_K, num_warps) to try for a Qwen3-0.6B shape at M = 1."""
    bk = 1 << (k - 1).bit_length()
    bns = (4, 8, 16, 32) if name == "lm_head" else (1, 2, 4, 8)
    return [(bn, bk, w) for bn in bns for w in (2, 4, 8) if bn * bk <= 128 * 32 * w]  # product floats/thread


def sweep_tiles(m: int, k: int, norm: bool) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps) for the Qwen3-8B shapes at M rows. Whole-row tiles (rows up to 4096,
    the kernel's norm limit) of at most 128 product floats a thread; without a norm also BLOCK_K 1024-4096
    below the row, 8-64 a thread. ptxas for sm_90 spills a few of the 128s (and, with 16 warps' 128
    registers, some 64s); the timing decides. ~70 compiles at M = 1, ~60 at M = 2."""
    m_p2, row = 1 << (m - 1).bit_length(), 1 << (k - 1).bit_length()
    warps, out = (4, 8, 16), []
    if row <= 4096:
        out += [(bn, row, w) for bn in (1, 2, 4, 8, 16) for w in warps if m_p2 * bn * row <= 128 * 32 * w]
    if not norm:
        out += [(bn, bk, w) for bk in (1024, 2048, 4096) if bk < row for bn in (1, 2, 4, 8) for w in warps
                if 8 * 32 * w <= m_p2 * bn * bk <= 64 * 32 * w]  # fmt: skip
    return out


def candidates(args: argparse.Namespace, name: str, m: int, k: int, norm: bool) -> list[tuple[int, int, int]]:
    if args.smoke:
        grid = SMOKE_TILES
    elif args.shape == "qwen3-0.6b":
        grid = chain_candidates(name, k) if args.chain else tile_grid(m)
    else:
        grid = sweep_tiles(m, k, norm)
    return [t for t in grid if not norm or t[1] >= k]  # a norm prologue needs the whole row in one tile


def env_entry(m: int, name: str, n: int, k: int, tile: tuple[int, int, int]) -> str:
    """tile as a TURNOUT_GEMV_TILES entry, or why it cannot be one: the variable sets (BLOCK_N, num_warps)
    and BLOCK_K stays tiles()'s for the shape's prologue."""
    from turnout.bench import gemv_tiles as tiles

    bk = tiles(m, n, k, name in NORM, name in SILU)[1]
    if tile[1] != bk:
        return f"BLOCK_K {tile[1]} not expressible (TURNOUT_GEMV_TILES keeps {bk})"
    return f"{n}x{k}={tile[0]},{tile[2]}"


def fmt(tile: tuple[int, int, int] | None) -> str:
    return ",".join(map(str, tile)) if tile else "-"


def time_ms(fn, smoke: bool, iters: int) -> float:
    if smoke:
        fn()
        return float("nan")
    return cuda_time_ms(fn, iters=iters, warmup=3)


def prologue_ref(x: torch.Tensor, res: torch.Tensor | None, norm_w: torch.Tensor | None, silu: bool):
    """The matmul's input as the model's unfused kernels compute it (layers/fused.py), which round as the
    GEMV's prologue does (under the interpreter too, whose float32 -> bf16 truncates)."""
    from turnout.bench import rms_norm, silu_and_mul

    if silu:  # x is [M, 2K]: gate, then up
        return silu_and_mul(x)
    return x if norm_w is None else rms_norm(x, norm_w, EPS, res)[0]


def bench_case(args, name: str, n: int, k: int, m: int, w: torch.Tensor, norm: bool, silu: bool) -> dict:
    from turnout.bench import gemv
    from turnout.bench import gemv_tiles as tiles

    smoke, iters = args.smoke, args.iters
    g = torch.Generator(device=w.device).manual_seed(n + k + m)
    x = torch.randn(m, 2 * k if silu else k, generator=g, device=w.device).to(torch.bfloat16)  # [M, K]
    res = torch.randn(m, k, generator=g, device=w.device).to(torch.bfloat16) if norm else None
    norm_w = torch.ones(k, dtype=torch.bfloat16, device=w.device) if norm else None
    xt = prologue_ref(x, res, norm_w, silu)
    ref = F.linear(xt, w)
    ulp2 = 2 * 2**-8 * ref.float().abs().max().item() + 1e-3
    nbytes = 2 * (n * k + m * k + m * n)
    kwargs = {"norm": (norm_w, EPS), "residual": res} if norm else {"silu_mul": True} if silu else {}

    def run(tile):
        y = gemv(x, w, tile=tile, **kwargs)
        return y[0] if norm else y

    cublas = time_ms(lambda: F.linear(xt, w), smoke, iters)
    default = tiles(m, n, k, norm, silu)
    timed = {}
    for tile in dict.fromkeys([default, *candidates(args, name, m, k, norm)]):
        try:
            y = run(tile)
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            print(f"{name} m={m} tile {tile}: {type(e).__name__}", flush=True)
            continue
        if (y.float() - ref.float()).abs().max().item() > ulp2:
            raise SystemExit(f"{name} m={m} tile {tile}: output differs from F.linear")
        timed[tile] = time_ms(lambda t=tile: run(t), smoke, iters)
    if not timed:
        raise SystemExit(f"{name} m={m}: no tile ran")

    def pick(pool):  # nan (smoke): any
        return min(pool, key=lambda t: timed[t] if timed[t] == timed[t] else 0.0) if pool else None

    best = pick(list(timed))
    best_env = pick([t for t in timed if "=" in env_entry(m, name, n, k, t)])
    row = {"shape": name, "N": n, "K": k, "M": m, "cublas_us": cublas * 1e3,
           "cublas_pct_bw": nbytes / (cublas * 1e-3) / BANDWIDTH * 100,
           "triton_default_us": timed.get(default, float("nan")) * 1e3,
           "best_tile": fmt(best),
           "best_us": timed[best] * 1e3, "best_pct_bw": nbytes / (timed[best] * 1e-3) / BANDWIDTH * 100,
           "speedup_best": cublas / timed[best]}  # fmt: skip
    summary = {"shape": name, "M": m, "N x K": f"{n}x{k}", "default_tile": fmt(default),
               "default_us": row["triton_default_us"], "best_tile": fmt(best), "best_us": row["best_us"],
               "cublas_us": row["cublas_us"], "floor_us": 2 * n * k / BANDWIDTH * 1e6,
               "env": env_entry(m, name, n, k, best)}  # fmt: skip
    if best_env != best:
        summary["env"] += f"; best expressible {fmt(best_env)}" + (
            f" {timed[best_env] * 1e3:.1f} us = {env_entry(m, name, n, k, best_env)}" if best_env else ""
        )
    return {**row, "_summary": summary, "_env": env_entry(m, name, n, k, best_env) if best_env else None}


def run_isolated(args: argparse.Namespace, model: Model) -> None:
    if args.smoke and args.shape == "qwen3-0.6b":
        shapes = SMOKE_SHAPES
    else:
        shapes = model.shapes(args.layers)
    dev = "cpu" if args.smoke else "cuda"
    rows, step, summary, env = [], {}, [], {}
    for name, n, k, per_step in shapes:
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, generator=g, device=dev) / k**0.5).to(torch.bfloat16)  # [N, K]
        norm, silu = args.prologue and name in NORM, args.prologue and name in SILU
        for m in args.m:
            row = bench_case(args, name, n, k, m, w, norm, silu)
            summary.append(row.pop("_summary"))
            if (entry := row.pop("_env")) is not None:
                env.setdefault(m, []).append(entry)
            rows.append(row)
            print(row, flush=True)
            acc = step.setdefault(m, {"M": m, "cublas_step_us": 0.0, "best_step_us": 0.0})
            acc["cublas_step_us"] += per_step * row["cublas_us"]
            acc["best_step_us"] += per_step * row["best_us"]
        del w
    print_table(rows)
    print()
    print_table(list(step.values()))
    print(f"\n{args.shape}: by shape and M (us; floor = weight bytes at {BANDWIDTH / 1e12:.1f} TB/s)")
    print_table(summary)
    envs = {m: ";".join(e) for m, e in env.items()}
    for m, value in envs.items():
        print(f"M = {m}: TURNOUT_GEMV_TILES='{value}'  (best tiles with tiles()'s BLOCK_K)")
    write_json(args.json, rows, args, step=list(step.values()), bandwidth=BANDWIDTH, summary=summary,
               env_by_m={str(m): v for m, v in envs.items()},
               triton_interpret=os.environ.get("TRITON_INTERPRET") == "1")  # fmt: skip


ROUTES = ("cublas", "triton", "fused")  # F.linear; the Triton GEMV; the Triton GEMV with its prologue


def chain_step(m: int, model: Model, layers: int, device: str):
    """A batch-m decode step's matmuls and q/k norm + rotary kernels (random weights, `layers` layers, each
    its own): returns step(tile_of, route_of) -> logits. route_of[shape] (default "fused" for every shape)
    is one of ROUTES: F.linear after separate norm and SiLU-and-mul kernels, the Triton GEMV after them,
    or the Triton GEMV with the norm (qkv, gate_up) or SiLU-and-mul (down) in its prologue, as the model
    launches it; tile_of[shape] is the GEMV's tile."""
    from turnout.bench import gemv, qk_norm_rope, rms_norm, silu_and_mul

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5).to(torch.bfloat16)

    shapes = model.shapes(layers)
    weights = [{name: rand(n, k) for name, n, k, _ in shapes if name != "lm_head"} for _ in range(layers)]
    lm_head = rand(*shapes[-1][1:3])
    ones = torch.ones(model.hidden, dtype=torch.bfloat16, device=device)
    head_ones = torch.ones(model.head_dim, dtype=torch.bfloat16, device=device)
    half = model.head_dim // 2
    cos, sin = torch.randn(4096, half, device=device), torch.randn(4096, half, device=device)
    x, pos = rand(m, model.hidden), torch.arange(m, device=device) + 100
    heads = (model.heads, model.kv_heads)

    def step(tile_of: dict[str, tuple[int, int, int]], route_of: dict[str, str] | None = None):
        route = dict.fromkeys(tile_of, "fused") | (route_of or {})

        def matmul(name, w, a):
            return F.linear(a, w) if route[name] == "cublas" else gemv(a, w, tile=tile_of[name])

        def normed(name, w, h, res):  # (RMSNorm(h + res) @ w^T, h + res)
            if route[name] == "fused":
                return gemv(h, w, tile=tile_of[name], norm=(ones, EPS), residual=res)
            a, res = rms_norm(h, ones, EPS, res)
            return matmul(name, w, a), res

        h, res = x, x
        for w in weights:
            qkv, res = normed("qkv", w["qkv"], h, res)
            q, _ = qk_norm_rope(qkv, pos, *heads, cos, sin, head_ones, head_ones, EPS)
            gu, res = normed("gate_up", w["gate_up"], matmul("o", w["o"], q.view(m, -1)), res)
            if route["down"] == "fused":
                h = gemv(gu, w["down"], tile=tile_of["down"], silu_mul=True)
            else:
                h = matmul("down", w["down"], silu_and_mul(gu))
        return matmul("lm_head", lm_head, rms_norm(h, ones, EPS, res)[0])

    return step


def graph_us(fn, smoke: bool, iters: int) -> float:
    """Median replay time of fn captured in one CUDA graph (us); under --smoke fn runs once, untimed."""
    fn()  # compile outside the capture
    if smoke:
        return float("nan")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, iters=iters, warmup=3) * 1e3


def run_chain(args: argparse.Namespace, model: Model) -> None:
    """Coordinate descent over the shapes' tiles, each candidate timed as a replayed CUDA graph of a step."""
    from turnout.bench import gemv_tiles as tiles

    m = 1
    layers = args.layers or model.layers
    shapes = model.shapes(layers)
    default = {name: tiles(m, n, k, name in NORM, name in SILU) for name, n, k, _ in shapes}
    best = dict(default)
    step = chain_step(m, model, layers, "cpu" if args.smoke else "cuda")
    cublas = dict.fromkeys(best, "cublas")

    def step_cublas() -> torch.Tensor:
        return step(best, cublas)

    def time_step(fn) -> float:
        return graph_us(fn, args.smoke, args.iters)

    ref, logits = step_cublas(), step(best)
    rel = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"default tiles against the cuBLAS step: max |difference| {rel:.3g} of max |logit|", flush=True)
    if args.smoke and not rel < 0.05:
        raise SystemExit("the Triton step's logits differ from the cuBLAS step's")
    cublas_us = time_step(step_cublas)
    default_us = time_step(lambda: step(best))
    rows = [{"shape": "default", "tile": "", "step_us": default_us}]
    print(rows[0], flush=True)
    best_us = default_us
    best_env = {}  # shape -> (its best tile with tiles()'s BLOCK_K, step us), from its own sweep
    for name, n, k, _ in shapes:
        best_env[name] = (best[name], best_us)  # the default tile, the other shapes as held below
        for tile in candidates(args, name, m, k, name in NORM):
            if tile == best[name]:
                continue
            try:
                us = time_step(lambda t={**best, name: tile}: step(t))
            except Exception as e:  # registers or shared memory: the tile does not fit
                print(f"{name} {tile}: {type(e).__name__}", flush=True)
                continue
            rows.append({"shape": name, "tile": fmt(tile), "step_us": us})
            print(rows[-1], flush=True)
            if us < best_us:
                best[name], best_us = tile, us
            if "=" in env_entry(m, name, n, k, tile) and us < best_env[name][1]:
                best_env[name] = (tile, us)
    env_tiles = {name: t for name, (t, _) in best_env.items()}
    env = ";".join(env_entry(m, name, n, k, env_tiles[name]) for name, n, k, _ in shapes)
    env_us = best_us if env_tiles == best else time_step(lambda: step(env_tiles))
    floor_us = sum(per * 2 * n * k for _, n, k, per in shapes) / BANDWIDTH * 1e6
    print_table(rows)
    summary = [{"shape": name, "N x K": f"{n}x{k}", "default_tile": fmt(default[name]),
                "best_tile": fmt(best[name]), "env": env_entry(m, name, n, k, best[name])
                + ("" if env_tiles[name] == best[name] else f"; best expressible {fmt(env_tiles[name])}")}
               for name, n, k, _ in shapes]  # fmt: skip
    print(f"\n{args.shape}, {layers} layers, batch 1: best tile per shape (BLOCK_N, BLOCK_K, warps)")
    print_table(summary)
    print(
        f"\nstep: {default_us:.1f} us with the default tiles, {best_us:.1f} us with the best, "
        f"{env_us:.1f} us with TURNOUT_GEMV_TILES='{env}'; cuBLAS {cublas_us:.1f} us; "
        f"floor {floor_us:.1f} us (weight bytes at {BANDWIDTH / 1e12:.1f} TB/s)"
    )
    write_json(args.json, rows, args, default_step_us=default_us, best_step_us=best_us,
               best_tiles={name: list(t) for name, t in best.items()}, env=env, env_step_us=env_us,
               env_tiles={name: list(t) for name, t in env_tiles.items()}, cublas_step_us=cublas_us,
               floor_step_us=floor_us, layers=layers, summary=summary)  # fmt: skip


def run_routes(args: argparse.Namespace, model: Model) -> None:
    """Which matmuls of a captured batch-1 step go faster in the Triton GEMV than in cuBLAS: from every
    shape in cuBLAS, each shape in turn takes the fastest of its routes (ROUTES) with the others held at
    their best so far; the GEMVs keep gemv.tiles()'s tiles. Every routing's logits are checked against
    the all-cuBLAS step's."""
    from turnout.bench import gemv_tiles as tiles

    layers = args.layers or model.layers
    shapes = model.shapes(layers)
    tile_of = {name: tiles(1, n, k, name in NORM, name in SILU) for name, n, k, _ in shapes}
    step = chain_step(1, model, layers, "cpu" if args.smoke else "cuda")
    ref = step(tile_of, dict.fromkeys(tile_of, "cublas")).float()

    def timed(route_of: dict[str, str]) -> float:
        logits = step(tile_of, route_of).float()
        rel = ((logits - ref).abs().max() / ref.abs().max()).item()
        if not rel < 0.05:
            raise SystemExit(f"routing {route_of}: logits differ from the cuBLAS step's ({rel:.3g})")
        return graph_us(lambda: step(tile_of, route_of), args.smoke, args.iters)

    def label(route_of: dict[str, str]) -> str:
        return " ".join(f"{name}={r}" for name, r in route_of.items() if r != "cublas") or "all cublas"

    best = dict.fromkeys(tile_of, "cublas")
    best_us = cublas_us = timed(best)
    rows = [{"routing": label(best), "step_us": cublas_us, "vs_cublas": 1.0}]
    fused_us = timed(dict.fromkeys(tile_of, "fused"))
    rows.append({"routing": "all fused (the Triton GEMV with its prologues)", "step_us": fused_us,
                 "vs_cublas": fused_us / cublas_us})  # fmt: skip
    for name, *_ in shapes:
        for route in ROUTES[1:] if name in NORM + SILU else ("triton",):
            trial = {**best, name: route}
            us = timed(trial)
            rows.append({"routing": label(trial), "step_us": us, "vs_cublas": us / cublas_us})
            print(rows[-1], flush=True)
            if us < best_us:
                best, best_us = trial, us
    floor_us = sum(per * 2 * n * k for _, n, k, per in shapes) / BANDWIDTH * 1e6
    print_table(rows)
    print(
        f"\n{args.shape}, {layers} layers, batch 1: best routing {label(best)}: {best_us:.1f} us; all "
        f"cuBLAS {cublas_us:.1f} us; floor {floor_us:.1f} us (weight bytes at {BANDWIDTH / 1e12:.1f} TB/s)"
    )
    write_json(args.json, rows, args, best_routing=best, best_step_us=best_us, cublas_step_us=cublas_us,
               fused_step_us=fused_us, floor_step_us=floor_us, tiles={n: list(t) for n, t in tile_of.items()},
               layers=layers)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(MODELS), default="qwen3-0.6b", help="the model's matmul shapes")
    ap.add_argument("--m", type=int, nargs="+", help="rows (default 1 2 4 8; 1 2 for qwen3-8b)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--layers", type=int, help="decoder layers in the chain and step (default: the model's)")
    ap.add_argument("--prologue", action="store_true", help="time the model's norm / SiLU-and-mul prologues")
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: small shapes")
    ap.add_argument("--chain", action="store_true", help="time tiles in a captured batch-1 step (CUDA)")
    ap.add_argument("--routes", action="store_true", help="cuBLAS against the GEMV per shape, in a step")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.m is None:
        args.m = [1, 2] if args.shape == "qwen3-8b" else [1, 2, 4, 8]
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    model = (SMOKE_MODELS if args.smoke else MODELS)[args.shape]
    start = time.perf_counter()
    (run_routes if args.routes else run_chain if args.chain else run_isolated)(args, model)
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
