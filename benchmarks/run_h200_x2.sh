#!/usr/bin/env bash
# 2x H200 (NCCL), 2026-11-30: TP=2 against TP=1 (bf16 free-running and teacher-forced, and float32 where
# rounding cannot flip near-ties), and the mixed workload of #5 at TP=1, TP=2 and DP=2.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/workx2
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash scripts/device-setup.sh 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { grep -v -E "^INFO|Loading|Writing|Warning|warn|it/s\]" "$@"; }
echo "== float32 agreement, TP=1 vs TP=2 ($SECONDS s)"
timeout 150 python3 benchmarks/bench_parallel.py --configs tp1 tp2 --dtype float32 --executor multiproc \
  --skip-throughput --json "$OUT/parallel_fp32_check.json" > "$W/fp32.log" 2>&1
quiet "$W/fp32.log" | tail -4
echo "== bf16: agreement and mixed-workload throughput, TP=1, TP=2, DP=2 ($SECONDS s)"
timeout 330 python3 benchmarks/bench_parallel.py --configs tp1 tp2 dp2 --executor multiproc \
  --json "$OUT/parallel.json" > "$W/bf16.log" 2>&1
quiet "$W/bf16.log" | tail -6
echo "== done ($SECONDS s)"
tar czf "$OUT/logs_x2.tar.gz" -C "$W" .
