#!/usr/bin/env bash
# For the next session's first H200 call (FlashInfer + FA4 carried, FA4 part a stashed just before):
# what 2026-11-30 left unverified. FlashInfer conformance with the 512 MiB workspace and FA4 conformance to
# the end (parallel processes: FlashInfer JIT modules compile side by side), the Triton micro-benchmark after
# the empty-split change, and the CUDA-graph table at full size for the two fastest modes.
set -u
W=/tmp/worknext
source benchmarks/device_prologue.sh
echo "== conformance, FlashInfer and FA4 ($SECONDS s)"
export TURNOUT_CONFORMANCE_ERRORS="$W/conformance_errors.tsv"
conf fi_bf16_64 "flashinfer and bfloat16 and 64" &
conf fi_bf16_128 "flashinfer and bfloat16 and not 64" &
conf fi_fp16_64 "flashinfer and not bfloat16 and 64" &
conf fi_fp16_128 "flashinfer and not bfloat16 and not 64" &
conf fa_bf16 "flash_attn and bfloat16" &
conf fa_fp16 "flash_attn and not bfloat16" &
wait
unset TURNOUT_CONFORMANCE_ERRORS
python3 benchmarks/summarize_conformance.py --errors "$W/conformance_errors.tsv" --junit "$W"/conf_*.xml \
  --json "$OUT/conformance.json"
echo "== Triton micro-benchmark ($SECONDS s)"
timeout 40 python3 benchmarks/bench_attention.py --backends triton --json "$OUT/attention_triton.json" \
  > "$W/attention.log" 2>&1
quiet "$W/attention.log" | tail -9
echo "== graphs at full size: FULL and FULL_AND_PIECEWISE ($SECONDS s)"
timeout $((570 - SECONDS)) python3 benchmarks/bench_graphs.py --backends triton --modes FULL FULL_AND_PIECEWISE \
  --forward-batches 1 8 --json "$OUT/graphs_triton_full.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -3
tar czf "$OUT/logs_next.tar.gz" -C "$W" .
