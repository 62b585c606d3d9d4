#!/usr/bin/env bash
# Session 4's third H200 call: the graph table at the issue's full workload sizes, all five modes, Triton,
# with nothing else on the machine, after the GEMV default (layers/gemv.py). NONE runs last: it is the
# slowest, and every mode is compared with it when it has run. No wheels needed.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
W=/tmp/work4c
source benchmarks/device_prologue.sh
echo "== graphs at full size, five modes ($SECONDS s)"
timeout $((585 - SECONDS)) python3 benchmarks/bench_graphs.py --backends triton --forward-batches 1 8 256 \
  --modes FULL_AND_PIECEWISE FULL FULL_DECODE_ONLY PIECEWISE NONE \
  --json "$OUT/graphs_triton_full.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | grep -E "^\{" | cut -c1-400
quiet "$W/graphs.log" | tail -7
echo "== done ($SECONDS s)"
