#!/usr/bin/env bash
# H200 call 4 (2026-11-30): after the Triton decode split fix: Triton conformance and tests/test_gpu.py on
# the GPU, the decode/prefill micro-benchmark, graph modes vs NONE with TPOT, and FULL without fused kernels.
set -u
W=/tmp/work4
source benchmarks/device_prologue.sh
echo "== Triton conformance (background) and tests/test_gpu.py ($SECONDS s)"
TURNOUT_CONFORMANCE_ERRORS="$W/conformance_errors.tsv" timeout 110 python3 -m pytest -q -p no:cacheprovider \
  tests/test_attention_conformance.py -k triton --junitxml="$W/conf_triton.xml" > "$W/conf_triton.log" 2>&1 &
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k triton --junitxml="$W/gpu_tests.xml" \
  > "$W/gpu_tests.log" 2>&1
tail -2 "$W/gpu_tests.log"
wait
tail -1 "$W/conf_triton.log"
python3 benchmarks/summarize_conformance.py --errors "$W/conformance_errors.tsv" --junit "$W/conf_triton.xml" \
  --json "$OUT/conformance_triton.json" | tail -2
echo "== Triton micro-benchmark ($SECONDS s)"
timeout 40 python3 benchmarks/bench_attention.py --backends triton --json "$OUT/attention_triton.json" \
  > "$W/attention.log" 2>&1
quiet "$W/attention.log" | tail -9
echo "== graphs NONE / FULL / FULL_AND_PIECEWISE, 1/8 workloads ($SECONDS s)"
timeout 120 python3 benchmarks/bench_graphs.py --backends triton --modes NONE FULL FULL_AND_PIECEWISE --quick \
  --forward-batches 1 8 --json "$OUT/graphs_triton_quick.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -4
echo "== FULL without the fused kernels ($SECONDS s)"
timeout 40 python3 benchmarks/bench_graphs.py --backends triton --modes FULL --unfused --skip-throughput \
  --tpot-batches 1 8 --forward-batches 1 --json "$OUT/graphs_triton_unfused.json" > "$W/unfused.log" 2>&1
quiet "$W/unfused.log" | tail -2
echo "== done ($SECONDS s)"
tar czf "$OUT/logs4.tar.gz" -C "$W" .
