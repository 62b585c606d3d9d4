#!/usr/bin/env bash
# H200 call 1 (2026-11-30): fused layer kernels, the conformance suite for all four backends (bf16 and fp16,
# head 64 and 128; FlashInfer's JIT modules compile in parallel processes), tests/test_gpu.py, kernel
# micro-benchmarks and the Triton prefill tile sweep. Needs .device-wheels/b and .device-deps carried (and
# .device-wheels/a stashed just before, for FlashAttention-4). Everything lands in $OUT: a few JSON files
# and logs.tar.gz.
set -u
W=/tmp/work
CONF_S=270
source benchmarks/device_prologue.sh
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
python3 -c "import flash_attn.cute; print('flash-attn-4 ok')" 2>&1 | tail -1
echo "== fused kernels ($SECONDS s)"
if ! timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py --junitxml="$W/fused.xml" > "$W/fused.log" 2>&1; then
  export TURNOUT_FUSED_KERNELS=0
  echo "fused kernels FAILED on the GPU: the rest runs unfused"
fi
tail -2 "$W/fused.log"
echo "== conformance + GPU tests, in parallel ($SECONDS s)"
export TURNOUT_CONFORMANCE_ERRORS="$W/conformance_errors.tsv"
conf fi_bf16_64 "flashinfer and bfloat16 and 64" &
conf fi_bf16_128 "flashinfer and bfloat16 and not 64" &
conf fi_fp16_64 "flashinfer and not bfloat16 and 64" &
conf fi_fp16_128 "flashinfer and not bfloat16 and not 64" &
conf fa "flash_attn" &
conf triton_cpu "triton or cpu" &
(TURNOUT_CONFORMANCE_ERRORS= timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  --junitxml="$W/gpu_tests.xml" > "$W/gpu_tests.log" 2>&1; echo "gpu tests: $(tail -1 "$W/gpu_tests.log")") &
wait
unset TURNOUT_CONFORMANCE_ERRORS
python3 benchmarks/summarize_conformance.py --errors "$W/conformance_errors.tsv" --junit "$W"/conf_*.xml \
  --json "$OUT/conformance.json"
grep -h -E "^FAILED|Error" "$W"/conf_*.log "$W/gpu_tests.log" | head -8
echo "== kernel micro-benchmarks ($SECONDS s)"
timeout 100 python3 benchmarks/bench_attention.py --backends triton,flashinfer,flash_attn \
  --json "$OUT/attention.json" > "$W/attention.log" 2>&1
grep -v -E "^INFO|Warning|warn" "$W/attention.log" | tail -22
echo "== Triton prefill tile sweep ($SECONDS s)"
timeout 120 python3 benchmarks/tune_triton.py --json "$OUT/tune_triton.json" > "$W/tune.log" 2>&1
tail -14 "$W/tune.log"
echo "== done ($SECONDS s)"
tar czf "$OUT/logs.tar.gz" -C "$W" .
