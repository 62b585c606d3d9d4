"""Attention kernel micro-benchmark for every installed attention backend (CUDA only).

Decode: batch 1, 32, 256 at context 512 and 4096, one query token per request; reports the KV + Q bytes
read per second and its share of the H200's ~4.3 TB/s. Prefill: one causal sequence of 4k and 16k tokens;
reports TFLOP/s (4 * N^2 / 2 * H * D for QK^T and PV) and its share of ~790 TFLOP/s bf16.
Times the impl's forward (KV write + attention) with CUDA events after an L2 flush, median of --iters:
eagerly (host launch overhead included) and, where the backend's cudagraph_support covers the batch,
replayed from a CUDA graph (kernel time); rates use the graph time when there is one. The builder's build
runs once per step in the engine and is timed on its own (meta_ms). Example:
  python benchmarks/bench_attention.py --backends triton --json /tmp/attention.json   # suite: attention
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import time
from pathlib import Path

import torch

from turnout.attention import AttentionBackend, AttentionContext, AttentionMetadata, AttentionSpec
from turnout.attention import CudagraphSupport as S
from turnout.bench import CEILINGS, current_platform

sys.path.insert(0, str(Path(__file__).parent))
from common import captured, cuda_time_ms, version, write_json  # noqa: E402

PEAK_BW, PEAK_FLOPS = CEILINGS["H200"].bytes_per_s, CEILINGS["H200"].flops_per_s  # copy, bf16 dense matmul
WARMUP = 5  # untimed runs before each timing


def discover(names: list[str] | None) -> list[AttentionBackend]:
    found = []
    for ep in md.entry_points(group="turnout"):
        try:
            hook = getattr(ep.load(), "turnout_attention_backends", None)
        except Exception as e:
            print(f"plugin {ep.name} failed to load: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        found += hook(platform=current_platform()) if hook else []
    return [b for b in found if names is None or b.name in names]


def make_step(
    seq_lens: list[int], query_lens: list[int], heads: tuple[int, int, int], spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q, k, v, a filled cache of shuffled blocks in the spec's cache dtype, and a step's metadata."""
    (h, kvh, d), dev, dtype, bs = heads, "cuda", spec.dtype, spec.block_size
    nblocks = [-(-s // bs) for s in seq_lens]
    ids = torch.randperm(sum(nblocks), device=dev, dtype=torch.int32)
    table = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32, device=dev)
    slots, start = [], 0
    for b, (n, s, ql) in enumerate(zip(nblocks, seq_lens, query_lens)):
        table[b, :n] = ids[start : start + n]
        start += n
        pos = torch.arange(s - ql, s, device=dev)
        slots.append(table[b, pos // bs].long() * bs + pos % bs)
    t = sum(query_lens)
    kv_cache = torch.randn(2, sum(nblocks), bs, kvh, d, device=dev, dtype=dtype).to(spec.cache_dtype)
    q, k, v = (torch.randn(t, n, d, device=dev, dtype=dtype) for n in (h, kvh, kvh))
    cu = torch.tensor([0] + query_lens, device=dev).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    decodes = sum(ql == 1 for ql in query_lens) if max(query_lens) == 1 else 0
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), query_start_loc=cu, seq_lens=lens,
                             block_table=table, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                             num_actual_tokens=t, num_decode_tokens=decodes)  # fmt: skip
    return q, k, v, kv_cache, meta


def run_case(be: AttentionBackend, kind: str, batch: int, ctx: int, args: argparse.Namespace) -> dict | None:
    dtype, heads = torch.bfloat16, (args.num_heads, args.num_kv_heads, args.head_size)
    m, kvd = be.block_size_multiple, args.kv_cache_dtype
    bs = args.block_size if args.block_size % m == 0 else m * -(-args.block_size // m)
    asked = AttentionContext(current_platform(), dtype, args.head_size, *heads[:2], bs, kv_cache_dtype=kvd)
    if reasons := be.check(asked):
        print(f"{be.name}: skipped ({'; '.join(reasons)})", file=sys.stderr)
        return None
    qlens = [1] * batch if kind == "decode" else [ctx]
    spec = AttentionSpec(*heads, dtype, bs, args.head_size**-0.5, num_layers=1, kv_cache_dtype=kvd)
    q, k, v, kv_cache, meta = make_step([ctx] * batch, qlens, heads, spec)
    builder, impl = be.make_builder(spec, 0), be.make_impl(spec, spec.layer(0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    meta.backend_data = builder.build(meta)
    torch.cuda.synchronize()
    meta_ms = (time.perf_counter() - t0) * 1e3

    def fwd() -> torch.Tensor:
        return impl.forward(q, k, v, kv_cache, meta)

    ms = cuda_time_ms(fwd, args.iters, WARMUP)
    # one prefill request is a uniform batch
    graphable = be.cudagraph_support >= (S.UNIFORM_DECODE if kind == "decode" else S.UNIFORM_BATCH)
    g_ms = cuda_time_ms(captured(fwd).replay, args.iters, WARMUP) if graphable else None
    row = dict(backend=be.name, kind=kind, batch=batch, context=ctx, block_size=bs, kv_cache_dtype=kvd)
    row.update(eager_ms=ms, graph_ms=g_ms, meta_ms=meta_ms)
    ms, esz = g_ms or ms, dtype.itemsize
    if kind == "decode":
        nbytes = batch * ctx * 2 * args.num_kv_heads * args.head_size * kv_cache.itemsize + q.numel() * esz
        row.update(gbps=nbytes / ms / 1e6, pct_peak=100 * nbytes / (ms * 1e-3) / PEAK_BW)
    else:
        flops = 2 * ctx * ctx * args.num_heads * args.head_size  # 4 N^2 H D, halved by the causal mask
        row.update(tflops=flops / ms / 1e9, pct_peak=100 * flops / (ms * 1e-3) / PEAK_FLOPS)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", help="comma-separated backend names (default: every valid one)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="raised to each backend's block-size multiple")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: e4m3, unit scales")
    p.add_argument("--kinds", choices=("all", "decode", "prefill"), default="all")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256], help="decode batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="decode context lengths")
    args = p.parse_args()
    if current_platform().device_type != "cuda":
        sys.exit("bench_attention: needs a CUDA device (none found, or TURNOUT_DEVICE=cpu); nothing measured")
    names = args.backends.split(",") if args.backends else None
    backends = discover(names)
    if not backends:
        sys.exit(f"bench_attention: no attention backend installed matches {names}")
    cases = [("decode", b, c) for b in args.batches for c in args.contexts] if args.kinds != "prefill" else []
    cases += [("prefill", 1, 4096), ("prefill", 1, 16384)] if args.kinds != "decode" else []
    rows = []
    print(f"{'backend':<10}{'case':<9}{'batch':>6}{'context':>8}{'eager ms':>10}{'graph ms':>10}", end="")
    print(f"{'rate':>15}{'% peak':>8}")
    for be in backends:
        for kind, batch, ctx in cases:
            torch.manual_seed(0)
            if (row := run_case(be, kind, batch, ctx, args)) is None:
                break
            rows.append(row)
            rate = f"{row['gbps']:.0f} GB/s" if kind == "decode" else f"{row['tflops']:.1f} TFLOP/s"
            g = "-" if row["graph_ms"] is None else f"{row['graph_ms']:.4f}"
            print(f"{be.name:<10}{kind:<9}{batch:>6}{ctx:>8}{row['eager_ms']:>10.4f}{g:>10}", end="")
            print(f"{rate:>15}{row['pct_peak']:>7.1f}%")
    peaks, capability = dict(bytes_per_s=PEAK_BW, flops=PEAK_FLOPS), list(torch.cuda.get_device_capability())
    write_json(args.json, rows, args, capability=capability, triton=version("triton"), peaks=peaks)


if __name__ == "__main__":
    main()
