"""Decode-sized matmuls: cuBLAS (F.linear) against turnout's Triton GEMV (core/layers/gemv.py) at the
Qwen3-0.6B shapes, with a sweep of the GEMV's tiles (issue #5: the matmuls are 907 of a batch-1 step's
1306 us of kernel time on the H200).

  python benchmarks/bench_gemv.py --json /tmp/gemv.json   # suite: gemv
  TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke   # CPU: small shapes, checks the script

Each case is timed with CUDA events after an L2 flush (median of --iters) and reported as achieved
bandwidth, counting the weight, x and y bytes, against 4.3 TB/s. Every tile's output is checked against
F.linear first (max abs difference within two bf16 ulps of the output). The last line projects one
decode step's matmul time (28 layers of the four projections, plus the LM head) for each M: cuBLAS,
and the best tile per shape. Use a tile with gemv(..., tile=) or make it the default in gemv.tiles().

--chain times tiles where they run: one batch-1 decode step's kernels as the model launches them (per
layer: the qkv GEMV with its norm prologue, the q/k norm + rotary kernel, the o GEMV on q's rows in
place of attention, gate_up with its norm, down with SiLU-and-mul; then the LM head), each layer with
its own weights, captured in one CUDA graph with programmatic dependent launch, as a FULL graph runs
them. Isolated timings miss how a GEMV's weight reads overlap the kernel before it. Each shape's
(BLOCK_N, num_warps) is chosen in turn, the others held at their best so far (median replay time over
--iters, each replay after an L2 flush); it prints the winners as a TURNOUT_GEMV_TILES value.

  python benchmarks/bench_gemv.py --chain --json /tmp/gemv-chain.json   # suite: gemv
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import cuda_time_ms, print_table, write_json  # noqa: E402

# (name, N, K, times per step): Qwen3-0.6B at TP=1, 28 layers, tied 151936-token LM head
SHAPES = [("qkv", 4096, 1024, 28), ("o", 1024, 2048, 28), ("gate_up", 6144, 1024, 28),
          ("down", 1024, 3072, 28), ("lm_head", 151936, 1024, 1)]  # fmt: skip
SMOKE_SHAPES = [("small", 96, 160, 1)]
BANDWIDTH = 4.3e12


def tile_grid(m: int, smoke: bool) -> list[tuple[int, int, int]]:
    if smoke:
        return [(4, 64, 4), (8, 128, 2)]
    ks = [k for k in (128, 256, 512, 1024) if k * m <= 2048]  # [M_P2, BN, BK] floats in registers
    return list(itertools.product((2, 4, 8), ks, (1, 2, 4)))  # ~18 compiles per M: a minute or two in all


def time_ms(fn, smoke: bool, iters: int) -> float:
    if smoke:
        fn()
        return float("nan")
    return cuda_time_ms(fn, iters=iters, warmup=3)


def bench_case(name: str, n: int, k: int, m: int, smoke: bool, iters: int) -> dict:
    from turnout.layers.gemv import gemv, tiles

    g = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=g).to("cpu" if smoke else "cuda", torch.bfloat16)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(x.device, torch.bfloat16)  # [N, K]
    ref = F.linear(x, w)
    ulp2 = 2 * 2**-8 * ref.float().abs().max().item() + 1e-3
    nbytes = 2 * (n * k + m * k + m * n)
    cublas = time_ms(lambda: F.linear(x, w), smoke, iters)
    timed = {}
    for tile in [tiles(m, n, k), *tile_grid(m, smoke)]:
        try:
            y = gemv(x, w, tile=tile)
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            print(f"{name} m={m} tile {tile}: {type(e).__name__}", flush=True)
            continue
        if (y.float() - ref.float()).abs().max().item() > ulp2:
            raise SystemExit(f"{name} m={m} tile {tile}: output differs from F.linear")
        timed[tile] = time_ms(lambda t=tile: gemv(x, w, tile=t), smoke, iters)
    best = min(timed, key=lambda t: timed[t] if timed[t] == timed[t] else 0.0)  # nan (smoke): any
    return {"shape": name, "N": n, "K": k, "M": m, "cublas_us": cublas * 1e3,
            "cublas_pct_bw": nbytes / (cublas * 1e-3) / BANDWIDTH * 100,
            "triton_default_us": timed.get(tiles(m, n, k), float("nan")) * 1e3,
            "best_tile": ",".join(map(str, best)),
            "best_us": timed[best] * 1e3, "best_pct_bw": nbytes / (timed[best] * 1e-3) / BANDWIDTH * 100,
            "speedup_best": cublas / timed[best]}  # fmt: skip


def chain_step(m: int):
    """A batch-m decode step's GEMVs and q/k norm + rotary kernels (Qwen3-0.6B shapes, random weights,
    28 layers): returns step(tile_of) -> logits, which launches them with the tiles of tile_of[shape]."""
    from turnout.layers import fused
    from turnout.layers.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") / shape[-1] ** 0.5).to(torch.bfloat16)

    layers = [{name: rand(n, k) for name, n, k, per in SHAPES if per > 1} for _ in range(28)]
    lm_head = rand(151936, 1024)
    ones = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    cos, sin = torch.randn(4096, 64, device="cuda"), torch.randn(4096, 64, device="cuda")
    x, pos = rand(m, 1024), torch.arange(m, device="cuda") + 100

    def step(tile_of: dict[str, tuple[int, int, int]]) -> torch.Tensor:
        h, res = x, x
        for w in layers:
            qkv, res = gemv(h, w["qkv"], tile=tile_of["qkv"], norm=(ones, 1e-6), residual=res)
            q, _ = fused.qk_norm_rope(qkv, pos, 16, 8, cos, sin, ones[:128], ones[:128], 1e-6)
            o = gemv(q.view(m, -1), w["o"], tile=tile_of["o"])
            gu, res = gemv(o, w["gate_up"], tile=tile_of["gate_up"], norm=(ones, 1e-6), residual=res)
            h = gemv(gu, w["down"], tile=tile_of["down"], silu_mul=True)
        return gemv(fused.rms_norm(h, ones, 1e-6, res)[0], lm_head, tile=tile_of["lm_head"])

    return step


def chain_candidates(name: str, k: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, whole-row BLOCK_K, num_warps) to try for a shape at M = 1."""
    bk = 1 << (k - 1).bit_length()
    bns = (4, 8, 16, 32) if name == "lm_head" else (1, 2, 4, 8)
    return [(bn, bk, w) for bn in bns for w in (2, 4, 8) if bn * bk <= 128 * 32 * w]  # product floats/thread


def run_chain(args: argparse.Namespace) -> None:
    """Coordinate descent over the shapes' tiles, each candidate timed as a replayed CUDA graph of a step."""
    from turnout.layers.gemv import tiles

    m = 1
    best = {name: tiles(m, n, k, name in ("qkv", "gate_up"), name == "down") for name, n, k, _ in SHAPES}

    step = chain_step(m)

    def time_step(tile_of: dict) -> float:
        step(tile_of)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(tile_of)
        return cuda_time_ms(graph.replay, iters=args.iters, warmup=3) * 1e3

    default_us = time_step(best)
    rows = [{"shape": "default", "tile": "", "step_us": default_us}]
    print(rows[0], flush=True)
    best_us = default_us
    for name, _, k, _ in SHAPES:
        for tile in chain_candidates(name, k):
            if tile == best[name]:
                continue
            try:
                us = time_step({**best, name: tile})
            except Exception as e:  # registers or shared memory: the tile does not fit
                print(f"{name} {tile}: {type(e).__name__}", flush=True)
                continue
            rows.append({"shape": name, "tile": ",".join(map(str, tile)), "step_us": us})
            print(rows[-1], flush=True)
            if us < best_us:
                best[name], best_us = tile, us
    env = ";".join(f"{n}x{k}={best[name][0]},{best[name][2]}" for name, n, k, _ in SHAPES)
    print_table(rows)
    print(
        f"\nstep {default_us:.1f} us with the default tiles, {best_us:.1f} us with TURNOUT_GEMV_TILES='{env}'"
    )
    write_json(args.json, rows, args, default_step_us=default_us, best_step_us=best_us,
               best_tiles={name: list(t) for name, t in best.items()}, env=env)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: small shapes")
    ap.add_argument("--chain", action="store_true", help="time tiles in a captured batch-1 step (CUDA)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    if args.chain:
        return run_chain(args)
    rows, step = [], {}
    for (name, n, k, per_step), m in itertools.product(SMOKE_SHAPES if args.smoke else SHAPES, args.m):
        row = bench_case(name, n, k, m, args.smoke, args.iters)
        rows.append(row)
        print(row, flush=True)
        acc = step.setdefault(m, {"M": m, "cublas_step_us": 0.0, "best_step_us": 0.0})
        acc["cublas_step_us"] += per_step * row["cublas_us"]
        acc["best_step_us"] += per_step * row["best_us"]
    print_table(rows)
    print()
    print_table(list(step.values()))
    write_json(args.json, rows, args, step=list(step.values()), bandwidth=BANDWIDTH,
               triton_interpret=os.environ.get("TRITON_INTERPRET") == "1")  # fmt: skip


if __name__ == "__main__":
    main()
