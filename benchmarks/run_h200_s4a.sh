#!/usr/bin/env bash
# Session 4's first H200 call (FlashInfer in .device-wheels/b; FA4 when part a was stashed just before):
#   0. the Triton GEMV against cuBLAS at the Qwen3-0.6B shapes (tile sweep), then FULL TPOT with it off/on;
#   1. where a decode step's time goes: batch 1 FULL with the GEMV on, batch 256 FULL_AND_PIECEWISE;
#   2. FlashInfer's conformance replay test (FlashInfer declares UNIFORM_DECODE);
#   3. FA4: a FULL capture with TURNOUT_FLASH_ATTN_CUDAGRAPH=ALWAYS, against NONE.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
W=/tmp/work4a
source benchmarks/device_prologue.sh
echo "== GEMV vs cuBLAS ($SECONDS s)"
timeout 200 python3 benchmarks/bench_gemv.py --json "$OUT/gemv.json" > "$W/gemv.log" 2>&1
quiet "$W/gemv.log" | grep -v "^{" | tail -34
for g in 0 1; do
  TURNOUT_TRITON_GEMV=$g timeout 100 python3 benchmarks/bench_graphs.py --modes NONE FULL --quick \
    --skip-throughput --tpot-batches 1 8 --forward-batches 1 8 --json "$OUT/graphs_gemv$g.json" > "$W/graphs_gemv$g.log" 2>&1
  echo "TURNOUT_TRITON_GEMV=$g"; quiet "$W/graphs_gemv$g.log" | tail -3
done
echo "== profile ($SECONDS s)"
TURNOUT_TRITON_GEMV=1 timeout 100 python3 benchmarks/profile_decode.py --modes FULL --batch 1 \
  --json "$OUT/profile_b1_gemv.json" > "$W/profile_b1.log" 2>&1
quiet "$W/profile_b1.log" | tail -14
timeout 100 python3 benchmarks/profile_decode.py --modes FULL_AND_PIECEWISE --batch 256 \
  --json "$OUT/profile_b256.json" > "$W/profile_b256.log" 2>&1
quiet "$W/profile_b256.log" | tail -14
echo "== FlashInfer conformance replay ($SECONDS s)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_conformance.py \
  -k "cudagraph_replay" > "$W/replay.log" 2>&1; tail -3 "$W/replay.log"
echo "== FA4 FULL capture ($SECONDS s)"
TURNOUT_FLASH_ATTN_CUDAGRAPH=ALWAYS timeout 150 python3 benchmarks/bench_graphs.py --backends flash_attn \
  --modes NONE FULL --quick --skip-throughput --tpot-batches 1 64 --json "$OUT/graphs_fa4_full.json" \
  > "$W/fa4.log" 2>&1
quiet "$W/fa4.log" | grep -E "^\{|Error|^\|" | cut -c1-300 | tail -6
echo "== done ($SECONDS s)"
tar czf "$OUT/logs_4a.tar.gz" -C "$W" .
