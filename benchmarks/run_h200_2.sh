#!/usr/bin/env bash
# H200 call 2 (2026-11-30), on the machine call 1 left warm (the GPU libraries are installed already):
# the CUDA-graph table at full size for Triton (all five modes), end-to-end agreement on both model shapes,
# graph modes vs NONE for FlashInfer and FlashAttention-4, and one FlashInfer FULL_DECODE_ONLY capture try.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/work2
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
python3 -c "import turnout, flashinfer" 2>/dev/null || { source .device-wheels/b/install.sh > "$W/install.log" 2>&1; bash scripts/device-setup.sh 2>&1 | tail -1; }
bash scripts/device-setup.sh > /dev/null 2>&1  # this tree's plugins (editable), in case they changed
quiet() { grep -v -E "^INFO|Loading|Writing|Warning|warn|it/s\]" "$@"; }
echo "== graphs, Triton, full size ($SECONDS s)"
timeout ${GRAPHS_S:-280} python3 benchmarks/bench_graphs.py --backends triton --forward-batches 1 8 \
  --json "$OUT/graphs_triton.json" > "$W/graphs_triton.log" 2>&1
quiet "$W/graphs_triton.log" | tail -8
echo "== e2e agreement ($SECONDS s)"
timeout 150 python3 benchmarks/gpu_e2e.py --json "$OUT/e2e.json" > "$W/e2e.log" 2>&1
quiet "$W/e2e.log" | tail -9
echo "== graphs vs NONE, FlashInfer and FA4 ($SECONDS s)"
timeout 100 python3 benchmarks/bench_graphs.py --backends flashinfer flash_attn --modes NONE PIECEWISE FULL \
  --quick --skip-throughput --tpot-batches 1 --forward-batches --json "$OUT/graphs_fi_fa4.json" > "$W/graphs_fi_fa4.log" 2>&1
quiet "$W/graphs_fi_fa4.log" | tail -8
echo "== FlashInfer FULL_DECODE_ONLY capture try ($SECONDS s)"
TURNOUT_FLASHINFER_CUDAGRAPH=UNIFORM_DECODE timeout 45 python3 benchmarks/bench_graphs.py --backends flashinfer \
  --modes NONE FULL_DECODE_ONLY --quick --skip-throughput --tpot-batches 1 --forward-batches 1 \
  --json "$OUT/graphs_fi_capture.json" > "$W/graphs_fi_capture.log" 2>&1
quiet "$W/graphs_fi_capture.log" | tail -5
echo "== done ($SECONDS s)"
tar czf "$OUT/logs2.tar.gz" -C "$W" .
