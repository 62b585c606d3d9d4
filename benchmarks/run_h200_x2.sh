#!/usr/bin/env bash
# 2x H200 (NCCL); written 2026-11-30, when the 2-GPU kind was not lent, for the next session: the CUDA-graph table (Triton, all five modes,
# 1/8-size workloads) on GPU 0 with the fused layer kernels; then TP=2 against TP=1 (bf16 and float32) and
# the mixed workload of #5 (1/8 size) at TP=1, TP=2 and DP=2.
set -u
W=/tmp/workx2
source benchmarks/device_prologue.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== fused kernels ($SECONDS s)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py > "$W/fused.log" 2>&1; tail -1 "$W/fused.log"
echo "== graphs, Triton, five modes, 1/8 workloads ($SECONDS s)"
CUDA_VISIBLE_DEVICES=0 timeout 210 python3 benchmarks/bench_graphs.py --backends triton --quick \
  --forward-batches 1 8 --json "$OUT/graphs_triton_quick.json" > "$W/graphs.log" 2>&1
quiet "$W/graphs.log" | tail -7
echo "== bf16: agreement and mixed throughput (1/8), TP=1, TP=2, DP=2 ($SECONDS s)"
timeout 170 python3 benchmarks/bench_parallel.py --configs tp1 tp2 dp2 --executor multiproc --quick \
  --json "$OUT/parallel.json" > "$W/bf16.log" 2>&1
quiet "$W/bf16.log" | tail -5
echo "== float32 agreement, TP=1 vs TP=2 ($SECONDS s)"
timeout $((540 - SECONDS)) python3 benchmarks/bench_parallel.py --configs tp1 tp2 --dtype float32 \
  --executor multiproc --skip-throughput --json "$OUT/parallel_fp32_check.json" > "$W/fp32.log" 2>&1
quiet "$W/fp32.log" | tail -4
echo "== done ($SECONDS s)"
tar czf "$OUT/logs_x2.tar.gz" -C "$W" .
