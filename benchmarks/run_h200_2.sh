#!/usr/bin/env bash
# H200 call 2 (2026-11-30): fused kernels on the GPU, the CUDA-graph table at full size for Triton (all five
# modes), end-to-end agreement on both model shapes and all three GPU backends, and graph modes vs NONE for
# FlashInfer and FlashAttention-4. Carry .device-wheels/b and .device-deps (FA4: stash .device-wheels/a
# just before).
set -u
W=/tmp/work2
source benchmarks/device_prologue.sh
echo "== fused kernels ($SECONDS s)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py --junitxml="$W/fused.xml" > "$W/fused.log" 2>&1 \
  || { export TURNOUT_FUSED_KERNELS=0; echo "fused kernels FAILED: the rest runs unfused"; }
tail -1 "$W/fused.log"
echo "== graphs, Triton, full size ($SECONDS s)"
timeout ${GRAPHS_S:-260} python3 benchmarks/bench_graphs.py --backends triton --forward-batches 1 8 \
  --json "$OUT/graphs_triton.json" > "$W/graphs_triton.log" 2>&1
quiet "$W/graphs_triton.log" | tail -8
echo "== e2e agreement ($SECONDS s)"
timeout 130 python3 benchmarks/gpu_e2e.py --json "$OUT/e2e.json" > "$W/e2e.log" 2>&1
quiet "$W/e2e.log" | tail -9
echo "== graphs vs NONE, FlashInfer and FA4 ($SECONDS s)"
timeout $((575 - SECONDS)) python3 benchmarks/bench_graphs.py --backends flashinfer flash_attn \
  --modes NONE PIECEWISE FULL --quick --skip-throughput --tpot-batches --forward-batches \
  --json "$OUT/graphs_fi_fa4.json" > "$W/graphs_fi_fa4.log" 2>&1
quiet "$W/graphs_fi_fa4.log" | tail -8
echo "== done ($SECONDS s)"
tar czf "$OUT/logs2.tar.gz" -C "$W" .
