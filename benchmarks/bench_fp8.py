"""turnout-fp8's matmuls at the Qwen3-8B linear shapes against bf16 cuBLAS, on CUDA, by batch rows M: each
route (the FP8 GEMV, the Triton FP8 GEMM, torch._scaled_mm: row-wise, or 1 x 128 by 128 x 128 block
scaling) checked against float64 first, timed by CUDA-event medians (triton.testing.do_bench over rotating
inputs). --sweep also times every GEMM tile and GEMV tile of a small grid and prints the tables
kernels.GEMM_CONFIGS and kernels.ROUTES would hold (the fastest summed over the four shapes).

    python benchmarks/bench_fp8.py [--sweep] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
from turnout_fp8 import kernels
from turnout_fp8.method import dequantize

SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
GEMV_MS = [1, 2, 4]
GEMV_TILES = [(4, 4096, 4), (8, 4096, 4), (16, 4096, 8)]


def gemm_tiles(m: int) -> list[tuple[int, int, int, int]]:
    """The sweep's GEMM tiles (BLOCK_M, BLOCK_N, warps, stages) for M rows."""
    m_p2 = triton.next_power_of_2(max(m, 16))
    block_ms = {16: (16,), 32: (16, 32), 64: (32, 64)}.get(m_p2, (64, 128))
    return list(itertools.product(block_ms, (64, 128, 256), (4, 8), (3, 4)))


def weights(n: int, k: int, block):
    w = torch.randn(n, k, device="cuda") * 0.02
    bn, bk = block or (1, k)
    s = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448
    s = s if block else s[:, 0]
    full = dequantize(torch.ones(n, k, device="cuda", dtype=kernels.FP8), s, block)
    return (w / full).clamp(-448, 448).to(kernels.FP8), s, w.bfloat16()


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
        for t in GEMV_TILES if sweep else ():
            r[f"gemv{t}"] = lambda x, q, s, t=t: kernels.fp8_gemv(x, q, s, block, t)
    if m >= 4 or block:
        r["triton"] = triton_gemm(block)
        for t in gemm_tiles(m) if sweep else ():
            r[f"triton{t}"] = triton_gemm(block, t)
    return r


def measure(scheme, block, name, q, s, wb, ref_w, m: int, sweep: bool) -> dict:
    """One shape at M rows: each route's error against float64 (the default tiles) and its median time."""
    n, k = wb.shape
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    row = {"scheme": scheme, "layer": name, "n": n, "k": k, "m": m}
    it = iter(range(1 << 62))
    nxt = lambda: xs[next(it) % 4]  # rotating inputs: x is not served from L2 alone
    bench = lambda f: triton.testing.do_bench(f, warmup=3, rep=10, return_mode="median") * 1e3
    row["bf16_us"] = bench(lambda: torch.nn.functional.linear(nxt(), wb))
    ref = xs[0].double() @ ref_w.t()
    for r, fn in routes(block, m, sweep).items():
        try:
            if "(" not in r:
                row[f"{r}_err"] = float((fn(xs[0], q, s).double() - ref).norm() / ref.norm())
            row[f"{r}_us"] = bench(lambda fn=fn: fn(nxt(), q, s))
        except Exception as e:  # a tile over the shared memory, or cuBLASLt without block scaling
            row[f"{r}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def best(rows: list[dict], scheme: str, m: int, prefix: str) -> tuple[str, float] | None:
    """The tile of `prefix` ("triton(" or "gemv(") with the least time summed over the shapes at M."""
    sel = [r for r in rows if r["scheme"] == scheme and r["m"] == m]
    keys = {key for r in sel for key in r if key.startswith(prefix) and key.endswith("_us")}
    totals = {key: sum(r[key] for r in sel) for key in keys if all(key in r for r in sel)}
    return min(totals.items(), key=lambda kv: kv[1]) if totals else None


def summary(rows: list[dict], sweep: bool) -> None:
    print("scheme   layer             M   bf16 us   gemv us triton us cublas us   auto us auto/bf16  max err")
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
    print("\nsummed over the shapes: scheme M  bf16 | default routes | best triton tile | best gemv tile")
    for scheme in ("channel", "block"):
        for m in sorted({r["m"] for r in rows}):
            sel = [r for r in rows if r["scheme"] == scheme and r["m"] == m]
            tot = {
                key: sum(r.get(key, nan) for r in sel)
                for key in ("bf16_us", "gemv_us", "triton_us", "cublas_us")
            }
            bt, bg = best(rows, scheme, m, "triton("), best(rows, scheme, m, "gemv(")
            print(f"{scheme:8} {m:5} {tot['bf16_us']:8.1f} | gemv {tot['gemv_us']:8.1f} "
                  f"triton {tot['triton_us']:8.1f} cublas {tot['cublas_us']:8.1f} | {bt} | {bg}")  # fmt: skip


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
            q, s, wb = weights(n, k, block)
            ref_w = dequantize(q, s, block).double()
            for m in (m for m in MS if m <= args.max_m):
                rows.append(measure(scheme, block, name, q, s, wb, ref_w, m, args.sweep))
            print(f"{scheme} {name} done at {time.time() - t0:.0f} s", flush=True)
    summary(rows, args.sweep)
    rates = matmul_rates()
    print(f"8192^3 matmul: bf16 {rates['bf16_tflops']:.0f} TFLOP/s, fp8 {rates['fp8_tflops']:.0f} TFLOP/s")
    print(f"{time.time() - t0:.0f} s")
    if args.out:
        doc = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": "python benchmarks/bench_fp8.py" + (" --sweep" if args.sweep else ""),
            "rows": rows,
            "matmul_rates": rates,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
