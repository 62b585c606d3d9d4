"""turnout-fp8's matmuls at the Qwen3-8B linear shapes against bf16 cuBLAS, on CUDA, by batch rows M: each
route (the FP8 GEMV, the Triton FP8 GEMM, torch._scaled_mm: row-wise, or 1 x 128 by 128 x 128 block
scaling) checked against float64 first, then timed as the engine runs it: inside
a CUDA graph (no launch gaps), back to back over copies of the weights that together exceed the L2 cache.
--sweep also times a small grid of GEMV tiles and prints the fastest summed over the four shapes;
kernels.ROUTES and gemv_tiles are set from it.

    python benchmarks/bench_fp8.py [--sweep] [--max-m M] [--out FILE.json]   # suite: fp8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
from turnout_fp8 import kernels
from turnout_fp8.method import dequantize

sys.path.insert(0, str(Path(__file__).parent))
from common import captured, write_json  # noqa: E402

SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
GEMV_MS = [1, 2, 4, 8]
ROTATE_BYTES = 256 << 20  # the weight copies a timing cycles through: over twice the H200's L2


def gemv_tiles(m: int) -> list[tuple[int, int, int]]:
    """The sweep's GEMV tiles (BLOCK_N, BLOCK_K, warps) for M rows."""
    m_p2 = triton.next_power_of_2(m)
    return [(bn, bk // m_p2, 4) for bn in (4, 8, 16) for bk in (512, 1024)]


def weights(n: int, k: int, block):
    w = torch.randn(n, k, device="cuda") * 0.02
    bn, bk = block or (1, k)
    s = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448
    s = s if block else s[:, 0]
    full = dequantize(torch.ones(n, k, device="cuda", dtype=kernels.FP8), s, block)
    return (w / full).clamp(-448, 448).to(kernels.FP8), s, w.bfloat16()


def graph_us(fn, args: list[tuple], reps: int = 5) -> float:
    """Median microseconds of one fn(*a) call, timed as replays of a CUDA graph that calls it for every a in
    args in turn (each a's tensors distinct, so the weights stream from memory as in a model's step)."""
    g = captured(lambda: [fn(*a) for a in args])
    g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(args))
    del g
    return sorted(times)[len(times) // 2]


def cublas(block):
    def run(x, q, s):
        xq, xs = kernels.quant_fp8(x, block[1] if block else None, col_major=block is not None)
        scale_b = s.t() if block else s.view(1, -1)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale_b, out_dtype=x.dtype)

    return run


def triton_gemm(block, tile=None):
    return lambda x, q, s: kernels.fp8_gemm(*kernels.quant_fp8(x, block[1] if block else None), q, s, block,
                                            x.dtype, tile)  # fmt: skip


def routes(block, m: int, sweep: bool) -> dict:
    r = {"auto": lambda x, q, s: kernels.fp8_linear(x, q, s, block, None, None), "cublas": cublas(block)}
    if m <= GEMV_MS[-1]:
        r["gemv"] = lambda x, q, s: kernels.fp8_gemv(x, q, s, block)
        for t in gemv_tiles(m) if sweep else ():
            r[f"gemv{t}"] = lambda x, q, s, t=t: kernels.fp8_gemv(x, q, s, block, t)
    r["triton"] = triton_gemm(block)
    return r


def measure(scheme, block, name, copies, ref_w, m: int, sweep: bool) -> dict:
    """One shape at M rows: each route's error against float64 (the default tiles) and its time."""
    n, k = copies[0][2].shape
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in copies]
    row = {"scheme": scheme, "layer": name, "n": n, "k": k, "m": m}
    row["bf16_us"] = graph_us(torch.nn.functional.linear, [(x, wb) for x, (_, _, wb) in zip(xs, copies)])
    ref = xs[0].double() @ ref_w.t()
    q, s, _ = copies[0]
    for r, fn in routes(block, m, sweep).items():
        try:
            if "(" not in r:
                row[f"{r}_err"] = float((fn(xs[0], q, s).double() - ref).norm() / ref.norm())
            row[f"{r}_us"] = graph_us(fn, [(x, q, s) for x, (q, s, _) in zip(xs, copies)])
        except Exception as e:  # a tile over the shared memory, or cuBLASLt without block scaling
            row[f"{r}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def best(rows: list[dict], scheme: str, m: int, prefix: str) -> tuple[str, float] | None:
    """The tile of `prefix` (e.g. "gemv(") with the least time summed over the shapes at M."""
    sel = [r for r in rows if r["scheme"] == scheme and r["m"] == m]
    keys = {key for r in sel for key in r if key.startswith(prefix) and key.endswith("_us")}
    totals = {key: sum(r[key] for r in sel) for key in keys if all(key in r for r in sel)}
    return min(totals.items(), key=lambda kv: kv[1]) if totals else None


def summary(rows: list[dict], sweep: bool) -> None:
    cols = "bf16 us   gemv us triton us cublas us   auto us auto/bf16  max err"
    print(f"scheme   layer             M   {cols}")
    nan = float("nan")
    for r in rows:
        errs = max([v for key, v in r.items() if key.endswith("_err")] or [nan])
        print(f"{r['scheme']:8} {r['layer']:13} {r['m']:5} {r['bf16_us']:9.1f} {r.get('gemv_us', nan):9.1f} "
              f"{r.get('triton_us', nan):9.1f} {r.get('cublas_us', nan):9.1f} {r['auto_us']:9.1f} "
              f"{r['auto_us'] / r['bf16_us']:9.2f} {errs:8.4f}")  # fmt: skip
    for r in rows:
        for key in r:
            if key.endswith("_error") and "(" not in key:
                print(f"{r['scheme']} {r['layer']} M={r['m']} {key}: {r[key]}")
    if not sweep:
        return
    print("\nsummed over the shapes: scheme M  bf16 | default routes | best gemv tile")
    for scheme in ("channel", "block"):
        for m in sorted({r["m"] for r in rows}):
            sel = [r for r in rows if r["scheme"] == scheme and r["m"] == m]
            tot = {
                key: sum(r.get(key, nan) for r in sel)
                for key in ("bf16_us", "gemv_us", "triton_us", "cublas_us")
            }
            bests = best(rows, scheme, m, "gemv(")
            print(f"{scheme:8} {m:5} {tot['bf16_us']:8.1f} | gemv {tot['gemv_us']:8.1f} "
                  f"triton {tot['triton_us']:8.1f} "
                  f"cublas {tot['cublas_us']:8.1f} | {bests}")  # fmt: skip


def matmul_rates(n: int = 8192) -> dict:
    """TFLOP/s of an n^3 matmul on random data: bf16 F.linear, and FP8 _scaled_mm with row-wise scales."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    aq, bq = a.to(kernels.FP8), b.to(kernels.FP8)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    ms_bf16 = triton.testing.do_bench(lambda: torch.nn.functional.linear(a, b), return_mode="median")
    fp8 = lambda: torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    ms_fp8 = triton.testing.do_bench(fp8, return_mode="median")
    return {"bf16_tflops": 2 * n**3 / ms_bf16 / 1e9, "fp8_tflops": 2 * n**3 / ms_fp8 / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time a grid of GEMM and GEMV tiles too")
    ap.add_argument("--max-m", type=int, default=MS[-1], help="rows M up to this only")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows, t0 = [], time.time()
    for scheme, block in (("channel", None), ("block", (128, 128))):
        for name, (n, k) in SHAPES.items():
            copies = [weights(n, k, block) for _ in range(max(2, -(-ROTATE_BYTES // (n * k))))]
            ref_w = dequantize(*copies[0][:2], block).double()
            for m in (m for m in MS if m <= args.max_m):
                rows.append(measure(scheme, block, name, copies, ref_w, m, args.sweep))
            del copies
            print(f"{scheme} {name} done at {time.time() - t0:.0f} s", flush=True)
    summary(rows, args.sweep)
    rates = matmul_rates()
    print(f"8192^3 matmul: bf16 {rates['bf16_tflops']:.0f} TFLOP/s, fp8 {rates['fp8_tflops']:.0f} TFLOP/s")
    print(f"{time.time() - t0:.0f} s")
    write_json(args.out, rows, args, matmul_rates=rates)


if __name__ == "__main__":
    main()
