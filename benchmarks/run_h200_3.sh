#!/usr/bin/env bash
# H200 call 3 (2026-11-30; the 2-GPU kind was not lent): the CUDA-graph table (Triton, all five modes, 1/8-size
# workloads) with the fused layer kernels, FULL without them for comparison, the Llama-shaped e2e row for
# Triton that call 2 ran out of time for, and tests/test_gpu.py for Triton.
set -u
W=/tmp/work3
source benchmarks/device_prologue.sh
echo "== fused kernels ($SECONDS s)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py --junitxml="$W/fused.xml" > "$W/fused.log" 2>&1
tail -1 "$W/fused.log"
echo "== graphs, Triton, five modes, 1/8 workloads ($SECONDS s)"
timeout 220 python3 benchmarks/bench_graphs.py --backends triton --quick --forward-batches 1 8 \
  --json "$OUT/graphs_triton_quick.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -7
echo "== FULL without the fused kernels ($SECONDS s)"
timeout 45 python3 benchmarks/bench_graphs.py --backends triton --modes FULL --unfused --skip-throughput \
  --tpot-batches 1 8 --forward-batches 1 --json "$OUT/graphs_triton_unfused.json" > "$W/unfused.log" 2>&1
quiet "$W/unfused.log" | tail -3
echo "== e2e, Llama shape, Triton ($SECONDS s)"
timeout 70 python3 benchmarks/gpu_e2e.py --shapes llama-360m --backends triton --json "$OUT/e2e_llama_triton.json" \
  > "$W/e2e.log" 2>&1
quiet "$W/e2e.log" | tail -3
echo "== tests/test_gpu.py, Triton ($SECONDS s)"
timeout $((520 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k triton \
  --junitxml="$W/gpu_tests.xml" > "$W/gpu_tests.log" 2>&1
tail -3 "$W/gpu_tests.log"
echo "== done ($SECONDS s)"
tar czf "$OUT/logs3.tar.gz" -C "$W" .
