#!/usr/bin/env bash
# Session 4: the full-size graph table, all five modes, Triton, after the GEMV default (layers/gemv.py). MODES picks
# the modes and their order (default all five, NONE last); TAG names the JSON. Nothing else runs on the machine.
# NONE is the slowest; every mode is compared with it once it has run. No wheels needed.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
MODES=${MODES:-FULL_AND_PIECEWISE FULL FULL_DECODE_ONLY PIECEWISE NONE}
W=/tmp/work4d
source benchmarks/device_prologue.sh
echo "== graphs at full size, five modes ($SECONDS s)"
timeout $((585 - SECONDS)) python3 benchmarks/bench_graphs.py --backends triton --forward-batches 1 8 256 \
  --modes $MODES \
  --json "$OUT/graphs_triton_full_${TAG:-rerun}.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | grep -E "^\{" | cut -c1-400
quiet "$W/graphs.log" | tail -7
echo "== done ($SECONDS s)"
