#!/usr/bin/env bash
# Session 4's last H200 call, after Triton's decode walks a request's splits on fewer programs at large
# batches (kernels.decode_programs): the Triton decode and replay conformance tests on the GPU; NONE,
# FULL_DECODE_ONLY, FULL_AND_PIECEWISE and PIECEWISE TPOT at batch 1, 64 and 256 with outputs against NONE;
# a batch-256 FULL_DECODE_ONLY step kernel by kernel. No wheels needed.
set -u
W=/tmp/work4e
source benchmarks/device_prologue.sh
echo "== Triton conformance on CUDA ($SECONDS s)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_attention_conformance.py \
  -k "triton and (split_count or replay or decode)" > "$W/conf.log" 2>&1; tail -1 "$W/conf.log"
echo "== graphs ($SECONDS s)"
timeout 170 python3 benchmarks/bench_graphs.py --modes NONE FULL_DECODE_ONLY FULL_AND_PIECEWISE PIECEWISE --quick \
  --skip-throughput --tpot-batches 1 64 256 --forward-batches 256 --json "$OUT/graphs_programs.json" > "$W/g.log" 2>&1
quiet "$W/g.log" | tail -6
echo "== profile b256 FULL_DECODE_ONLY ($SECONDS s)"
timeout $((290 - SECONDS)) python3 benchmarks/profile_decode.py --modes FULL_DECODE_ONLY --batch 256 \
  --json "$OUT/profile_b256_fdo.json" > "$W/p.log" 2>&1
quiet "$W/p.log" | tail -3
cp "$W/conf.log" "$OUT/conf_triton.log"
echo "== done ($SECONDS s)"
