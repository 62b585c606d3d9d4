#!/usr/bin/env bash
# 2x H200 (NCCL), session 3 (2026-11-30). Carries .device-wheels/b, .device-deps and .device-gguf/p3, after
# three stash calls on the same warm machine: .device-wheels/a (FA4) and .device-gguf/p1, p2 (the embedded
# SmolLM2's GGUF in parts: it is larger than one call may carry).
#   1. alone on both GPUs: TP=1 / TP=2 / DP=2 agreement and throughput on the full mixed workload of #5;
#   2. then side by side (correctness only, no timing): FlashInfer conformance on GPU 0 and FA4 conformance on
#      GPU 1 (4 processes each, so their JIT builds overlap), float32 TP=1 vs TP=2, and the end-to-end check
#      with the real SmolLM2-135M weights (backends against each other and against HF).
set -u
W=/tmp/workx2
source benchmarks/device_prologue.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cat /tmp/gguf-stash/gguf.part.* .device-gguf/p3/gguf.part.* > "$W/smollm2.gguf" && ls -la "$W/smollm2.gguf"
echo "== bf16: agreement and mixed throughput (full size), TP=1, TP=2, DP=2 ($SECONDS s)"
timeout 270 python3 benchmarks/bench_parallel.py --configs tp1 tp2 dp2 --executor multiproc \
  --json "$OUT/parallel.json" > "$W/bf16.log" 2>&1
quiet "$W/bf16.log" | tail -6
echo "== correctness side by side ($SECONDS s)"
export TURNOUT_CONFORMANCE_ERRORS="$W/conformance_errors.tsv" CONF_S=$((560 - SECONDS)) MAX_JOBS=8
CUDA_VISIBLE_DEVICES=0 conf fi_bf16_64 "flashinfer and bfloat16 and 64" &
CUDA_VISIBLE_DEVICES=0 conf fi_bf16_128 "flashinfer and bfloat16 and not 64" &
CUDA_VISIBLE_DEVICES=0 conf fi_fp16_64 "flashinfer and not bfloat16 and 64" &
CUDA_VISIBLE_DEVICES=0 conf fi_fp16_128 "flashinfer and not bfloat16 and not 64" &
CUDA_VISIBLE_DEVICES=1 conf fa_bf16_64 "flash_attn and bfloat16 and 64" &
CUDA_VISIBLE_DEVICES=1 conf fa_bf16_128 "flash_attn and bfloat16 and not 64" &
CUDA_VISIBLE_DEVICES=1 conf fa_fp16_64 "flash_attn and not bfloat16 and 64" &
CUDA_VISIBLE_DEVICES=1 conf fa_fp16_128 "flash_attn and not bfloat16 and not 64" &
unset TURNOUT_CONFORMANCE_ERRORS
(CUDA_VISIBLE_DEVICES=1 timeout $((CONF_S - 10)) python3 benchmarks/gpu_e2e.py --shapes smollm2-135m \
  --gguf "$W/smollm2.gguf" --hf-self --json "$OUT/e2e_smollm2.json" > "$W/e2e.log" 2>&1
  echo "e2e smollm2:"; quiet "$W/e2e.log" | tail -8) &
(timeout $((CONF_S - 10)) python3 benchmarks/bench_parallel.py --configs tp1 tp2 --dtype float32 \
  --executor multiproc --skip-throughput --gpu-memory-utilization 0.3 --json "$OUT/parallel_fp32_check.json" > "$W/fp32.log" 2>&1
  echo "fp32 check:"; quiet "$W/fp32.log" | tail -4) &
wait
python3 benchmarks/summarize_conformance.py --errors "$W/conformance_errors.tsv" --junit "$W"/conf_*.xml \
  --json "$OUT/conformance.json"
echo "== done ($SECONDS s)"
tar czf "$OUT/logs_x2.tar.gz" -C "$W" --exclude smollm2.gguf .
