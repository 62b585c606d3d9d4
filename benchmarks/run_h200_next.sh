#!/usr/bin/env bash
# For the next session's first H200 call (FlashInfer carried in .device-wheels/b; FA4 only if part a was
# stashed just before): what session 3 (2026-11-30) left unmeasured. More than one 10-minute call holds:
# the graph table (step 2) gets what time is left, or run it alone.
#   0. the Triton GEMV against cuBLAS at the Qwen3-0.6B shapes (tile sweep), then FULL TPOT with it on;
#   1. where a decode step's time goes at batch 1 and 256 (FULL_AND_PIECEWISE), host vs kernels;
#   2. the graph table at full size, all five modes, with nothing else on the machine (session 3's FULL row
#      ran beside JIT builds), after the graph-memory baseline fix;
#   3. FlashInfer's conformance replay test, which runs since FlashInfer declares UNIFORM_DECODE;
#   4. FA4 (needs part a stashed): a FULL capture with TURNOUT_FLASH_ATTN_CUDAGRAPH=ALWAYS, against NONE.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
W=/tmp/worknext
source benchmarks/device_prologue.sh
echo "== GEMV vs cuBLAS ($SECONDS s)"
timeout 200 python3 benchmarks/bench_gemv.py --json "$OUT/gemv.json" > "$W/gemv.log" 2>&1
quiet "$W/gemv.log" | tail -6
for g in 0 1; do
  TURNOUT_TRITON_GEMV=$g timeout 90 python3 benchmarks/bench_graphs.py --modes NONE FULL --quick \
    --skip-throughput --tpot-batches 1 8 --json "$OUT/graphs_gemv$g.json" > "$W/graphs_gemv$g.log" 2>&1
  echo "TURNOUT_TRITON_GEMV=$g"; quiet "$W/graphs_gemv$g.log" | tail -3
done
echo "== profile, batch 1 and 256 ($SECONDS s)"
for b in 1 256; do
  timeout 120 python3 benchmarks/profile_decode.py --modes FULL_AND_PIECEWISE --batch "$b" \
    --json "$OUT/profile_b$b.json" > "$W/profile_b$b.log" 2>&1
  quiet "$W/profile_b$b.log" | tail -3
done
echo "== FlashInfer conformance replay ($SECONDS s)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_conformance.py \
  -k "cudagraph_replay" > "$W/replay.log" 2>&1; tail -1 "$W/replay.log"
echo "== FA4 FULL capture ($SECONDS s)"
TURNOUT_FLASH_ATTN_CUDAGRAPH=ALWAYS timeout 150 python3 benchmarks/bench_graphs.py --backends flash_attn \
  --modes NONE FULL --quick --skip-throughput --tpot-batches 1 64 --json "$OUT/graphs_fa4_full.json" \
  > "$W/fa4.log" 2>&1
quiet "$W/fa4.log" | grep -E "^\{|Error" | cut -c1-300 | tail -3
echo "== graphs at full size, five modes ($SECONDS s)"
timeout $((SECONDS < 520 ? 580 - SECONDS : 60)) python3 benchmarks/bench_graphs.py --backends triton --forward-batches 1 8 256 \
  --modes FULL_AND_PIECEWISE FULL FULL_DECODE_ONLY PIECEWISE NONE \
  --json "$OUT/graphs_triton_full.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -7
tar czf "$OUT/logs_next.tar.gz" -C "$W" .
