#!/usr/bin/env bash
# 2x H200, session 3, second call (carries as run_h200_x2.sh, after the same three stash calls).
#   GPU 0, timing: the CUDA-graph table at full size for FULL and FULL_AND_PIECEWISE (Triton), then where a
#     batch-1 decode step's time goes (profile_decode.py);
#   GPU 1, correctness (niced, JIT builds limited to 8 jobs): the real-weight SmolLM2 end-to-end check, the
#     fp16 head-128/256 conformance slices the first call's time limit cut, and FlashInfer's FULL capture
#     tried with TURNOUT_FLASHINFER_CUDAGRAPH=UNIFORM_DECODE.
set -u
W=/tmp/workx2b
source benchmarks/device_prologue.sh
cat /tmp/gguf-stash/gguf.part.* .device-gguf/p3/gguf.part.* > "$W/smollm2.gguf"
export MAX_JOBS=8
(
  export CUDA_VISIBLE_DEVICES=1 TURNOUT_CONFORMANCE_ERRORS="$W/conformance_errors.tsv" CONF_S=420 CONF_PREFIX="nice -n 19"
  conf fi_fp16_big_a "flashinfer and not bfloat16 and not 64 and (decode or prefill or prefix or chunked)" &
  conf fi_fp16_big_b "flashinfer and not bfloat16 and not 64 and not (decode or prefill or prefix or chunked)" &
  conf fa_fp16_big_a "flash_attn and not bfloat16 and not 64 and (decode or prefill or prefix or chunked)" &
  conf fa_fp16_big_b "flash_attn and not bfloat16 and not 64 and not (decode or prefill or prefix or chunked)" &
  wait
) &
(
  export CUDA_VISIBLE_DEVICES=1
  nice -n 19 timeout 330 python3 benchmarks/gpu_e2e.py --shapes smollm2-135m --gguf "$W/smollm2.gguf" \
    --hf-self --json "$OUT/e2e_smollm2.json" > "$W/e2e.log" 2>&1
  echo "== e2e smollm2 ($SECONDS s)"; quiet "$W/e2e.log" | grep -v converting | tail -6
  TURNOUT_FLASHINFER_CUDAGRAPH=UNIFORM_DECODE nice -n 19 timeout $((560 - SECONDS)) python3 \
    benchmarks/bench_graphs.py --backends flashinfer --modes NONE FULL --quick --tpot-batches 1 64 \
    --json "$OUT/graphs_flashinfer_full.json" > "$W/fi_graphs.log" 2>&1
  echo "== FlashInfer FULL capture ($SECONDS s)"; quiet "$W/fi_graphs.log" | tail -5
) &
echo "== GPU 0: graphs at full size, FULL and FULL_AND_PIECEWISE ($SECONDS s)"
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/bench_graphs.py --backends triton \
  --modes FULL FULL_AND_PIECEWISE --forward-batches 1 8 --json "$OUT/graphs_triton_full.json" \
  > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -4
echo "== GPU 0: batch-1 decode profile ($SECONDS s)"
CUDA_VISIBLE_DEVICES=0 timeout $((565 - SECONDS)) python3 benchmarks/profile_decode.py --modes FULL \
  --json "$OUT/profile_decode.json" > "$W/profile.log" 2>&1
quiet "$W/profile.log" | tail -40
wait
python3 benchmarks/summarize_conformance.py --errors "$W/conformance_errors.tsv" --junit "$W"/conf_*.xml \
  --json "$OUT/conformance_fp16_big.json"
echo "== done ($SECONDS s)"
tar czf "$OUT/logs_x2b.tar.gz" -C "$W" --exclude smollm2.gguf .
