"""turnout-fp8's matmuls at the Qwen3-8B linear shapes against bf16 cuBLAS, on CUDA: each route (the FP8
GEMV, torch._scaled_mm with per-token x, the block-scaled Triton GEMM) by batch rows M, checked against
float64 first, timed by CUDA-event medians (triton.testing.do_bench over rotating inputs).

    python benchmarks/bench_fp8.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
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
MS = [1, 2, 4, 8, 16, 64, 256, 4096]


def weights(n: int, k: int, block):
    w = torch.randn(n, k, device="cuda") * 0.02
    bn, bk = block or (1, k)
    s = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448
    s = s if block else s[:, 0]
    full = dequantize(torch.ones(n, k, device="cuda", dtype=kernels.FP8), s, block)
    return (w / full).clamp(-448, 448).to(kernels.FP8), s, w.bfloat16()


def routes(block):
    r = {"gemv": lambda x, q, s: kernels.fp8_gemv(x, q, s, block)}
    for tile in ((2, 0, 4), (8, 0, 4), (16, 0, 8), (4, 512, 4)):
        r[f"gemv{tile}"] = lambda x, q, s, t=tile: kernels.fp8_gemv(
            x, q, s, block, (t[0], t[1] or kernels.gemv_tiles(*x.shape[:1], q.shape[0], q.shape[1])[1], t[2])
        )
    if block:
        r["block_gemm"] = lambda x, q, s: kernels.block_gemm(
            *kernels.quant_fp8(x, block[1]), q, s, block, x.dtype
        )
    else:
        r["scaled_mm"] = lambda x, q, s: torch._scaled_mm(
            *((xq := kernels.quant_fp8(x))[0],),
            q.t(),
            scale_a=xq[1],
            scale_b=s.view(1, -1),
            out_dtype=x.dtype,
        )
    r["auto"] = lambda x, q, s: kernels.fp8_linear(x, q, s, block, None, None)
    return r


def measure(scheme, block, name, q, s, wb, ref_w, m: int) -> dict:
    """One shape at M rows: each route's error against float64 and its median time, and bf16's time."""
    n, k = wb.shape
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    row = {"scheme": scheme, "layer": name, "n": n, "k": k, "m": m}
    it = iter(range(1 << 62))
    nxt = lambda: xs[next(it) % 4]  # rotating inputs: x is not served from L2 alone
    bench = lambda f: triton.testing.do_bench(f, return_mode="median") * 1e3
    row["bf16_us"] = bench(lambda: torch.nn.functional.linear(nxt(), wb))
    ref = xs[0].double() @ ref_w.t()
    for r, fn in routes(block).items():
        if r.startswith("gemv") and m > 16:
            continue
        row[f"{r}_err"] = float((fn(xs[0], q, s).double() - ref).norm() / ref.norm())
        row[f"{r}_us"] = bench(lambda fn=fn: fn(nxt(), q, s))
    return row


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
    ap.add_argument("--out")
    args = ap.parse_args()
    rows, t0 = [], time.time()
    for scheme, block in (("channel", None), ("block", (128, 128))):
        for name, (n, k) in SHAPES.items():
            q, s, wb = weights(n, k, block)
            ref_w = dequantize(q, s, block).double()
            for m in MS:
                rows.append(measure(scheme, block, name, q, s, wb, ref_w, m))
    print("scheme   layer             M   bf16 us   gemv us   gemm us   auto us  auto/bf16  max err")
    for r in rows:
        gemm, gemv = r.get("scaled_mm_us", r.get("block_gemm_us")), r.get("gemv_us", float("nan"))
        errs = max(v for key, v in r.items() if key.endswith("_err"))
        tiles = {key[4:-3]: v for key, v in r.items() if key.startswith("gemv(") and key.endswith("_us")}
        best = min(tiles, key=tiles.get) if tiles else ""
        print(f"{r['scheme']:8} {r['layer']:13} {r['m']:5} {r['bf16_us']:9.1f} {gemv:9.1f} {gemm:9.1f} "
              f"{r['auto_us']:9.1f} {r['auto_us'] / r['bf16_us']:10.2f} {errs:8.4f} {best} "
              f"{tiles.get(best, float('nan')):.1f}")  # fmt: skip
    rates = matmul_rates()
    print(f"8192^3 matmul: bf16 {rates['bf16_tflops']:.0f} TFLOP/s, fp8 {rates['fp8_tflops']:.0f} TFLOP/s")
    print(f"{time.time() - t0:.0f} s")
    if args.out:
        doc = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": "python benchmarks/bench_fp8.py",
            "rows": rows,
            "matmul_rates": rates,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
