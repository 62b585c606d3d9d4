#!/usr/bin/env bash
# For the next session's first H200 call (FlashInfer in .device-wheels/b; FA4 when part a was stashed just
# before): what session 4 (2026-11-30) changed after its last GPU call, and the table rows it could not
# repeat. The graph table needs most of a 10-minute call: run step 2 alone if steps 0-1 fail.
#   0. Triton conformance on the GPU, above all the float32 split-count test that failed at a59b545 (the
#      split reduce now adds splits in order, d9a7c62), and the fused / GEMV tests;
#   1. the default engine (FA4, now ALWAYS) end to end: Qwen3 shape vs HF, batched and batch 1;
#   2. the full-size graph table again, all five modes, with the untimed per-backend warm-up and the
#      decode_programs fix (the decode-heavy column predates it).
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
W=/tmp/worknext
source benchmarks/device_prologue.sh
echo "== conformance and fused kernels on CUDA ($SECONDS s)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_attention_conformance.py \
  -k "fused or gemv or (triton and (split_count or replay or decode))" -rf > "$W/conf.log" 2>&1
grep -E "^FAILED|passed|failed" "$W/conf.log" | tail -4
echo "== e2e, default backend ($SECONDS s)"
timeout 150 python3 benchmarks/gpu_e2e.py --shapes qwen3-0.6b --backends flash_attn --alone 4 \
  --json "$OUT/e2e_fa4.json" > "$W/e2e.log" 2>&1
quiet "$W/e2e.log" | grep -E "^\{|failed" | cut -c1-300
echo "== graphs at full size, five modes ($SECONDS s)"
timeout $((585 - SECONDS)) python3 benchmarks/bench_graphs.py --backends triton --forward-batches 1 8 256 \
  --modes FULL_AND_PIECEWISE FULL FULL_DECODE_ONLY PIECEWISE NONE \
  --json "$OUT/graphs_triton_full.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -7
tar czf "$OUT/logs_next.tar.gz" -C "$W" .
