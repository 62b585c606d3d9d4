#!/usr/bin/env bash
# Second H200 call of 2026-11-29: end-to-end agreement and FlashInfer/FA4 kernel timings.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source .device-wheels/b/install.sh > "$OUT/install.log" 2>&1
bash scripts/device-setup.sh 2>&1 | tail -1
step() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@" 2>&1 | grep -v -E "^INFO|Loading|Writing|Warning|warn" | tail -14; }
step 170 python3 benchmarks/gpu_e2e.py --shapes qwen3-0.6b --json "$OUT/e2e.json"
step 50 python3 benchmarks/bench_attention.py --backends flashinfer --json "$OUT/attention_flashinfer.json"
step 50 python3 benchmarks/bench_attention.py --backends flash_attn --eager --json "$OUT/attention_fa4.json"
