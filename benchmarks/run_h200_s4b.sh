#!/usr/bin/env bash
# Session 4's second H200 call (FlashInfer in .device-wheels/b, FA4 stashed from part a just before), after
# the GEMV became the default at M <= 2 with the RMSNorm and SiLU-and-mul prologues (layers/gemv.py):
#   0. tests/test_fused.py on CUDA (the kernels against float64 and the kernel-by-kernel path);
#   1. Triton: NONE / FULL / FULL_AND_PIECEWISE TPOT and forward at batch 1, 2, 8, 64, outputs vs NONE;
#   2. where a batch-1 FULL step goes now;
#   3. conformance replay tests, FA4 at ALWAYS (TURNOUT_FLASH_ATTN_CUDAGRAPH);
#   4. FlashInfer and FA4 (ALWAYS) in all five modes: 64 mixed prompts identical to NONE, TPOT b1;
#   5. batch-1 decode against HF (gpu_e2e --alone), Triton.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
W=/tmp/work4b
source benchmarks/device_prologue.sh
echo "== fused tests on CUDA ($SECONDS s)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py > "$W/fused.log" 2>&1; tail -2 "$W/fused.log"
echo "== Triton graphs, GEMV default ($SECONDS s)"
timeout 170 python3 benchmarks/bench_graphs.py --modes NONE FULL FULL_AND_PIECEWISE --quick --skip-throughput \
  --tpot-batches 1 2 8 64 --forward-batches 1 2 --json "$OUT/graphs_triton.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -4
echo "== profile b1 FULL ($SECONDS s)"
timeout 90 python3 benchmarks/profile_decode.py --modes FULL --batch 1 --json "$OUT/profile_b1.json" \
  > "$W/profile_b1.log" 2>&1
quiet "$W/profile_b1.log" | tail -3
echo "== conformance replay ($SECONDS s)"
TURNOUT_FLASH_ATTN_CUDAGRAPH=ALWAYS timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/test_attention_conformance.py -k "cudagraph_replay" -rs > "$W/replay.log" 2>&1; tail -6 "$W/replay.log"
echo "== FlashInfer, FA4 at ALWAYS: five modes ($SECONDS s)"
TURNOUT_FLASH_ATTN_CUDAGRAPH=ALWAYS timeout $((SECONDS < 300 ? 520 - SECONDS : 200)) python3 \
  benchmarks/bench_graphs.py --backends flash_attn flashinfer \
  --modes NONE PIECEWISE FULL FULL_DECODE_ONLY FULL_AND_PIECEWISE --quick --skip-throughput --tpot-batches 1 \
  --json "$OUT/graphs_fa4_fi_modes.json" > "$W/modes.log" 2>&1
quiet "$W/modes.log" | grep -E "^\{" | cut -c1-250
echo "== batch-1 decode vs HF ($SECONDS s)"
timeout $((580 - SECONDS)) python3 benchmarks/gpu_e2e.py --shapes qwen3-0.6b --backends triton --alone 8 \
  --json "$OUT/e2e_alone.json" > "$W/e2e.log" 2>&1
quiet "$W/e2e.log" | grep -E "^\{" | cut -c1-300
echo "== done ($SECONDS s)"
tar czf "$OUT/logs_4b.tar.gz" -C "$W" .
