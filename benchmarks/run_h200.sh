#!/usr/bin/env bash
# One H200 call: GPU attention libraries, conformance of the GPU backends, kernel micro-benchmarks,
# end-to-end agreement, and the CUDA-graph table. Each step has its own time limit, so a slow one
# cannot take the others' results with it; every step writes its JSON under $OUT as it finishes.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -f .device-wheels/b/install.sh ]; then source .device-wheels/b/install.sh > "$OUT/install.log" 2>&1; fi
bash scripts/device-setup.sh 2>&1 | tail -1
step() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@" 2>&1 | grep -v -E "^INFO|Loading|Writing" | tail -${TAIL:-12}; }
step 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py --junitxml="$OUT/gpu_tests.xml"
step 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_conformance.py -k "(flashinfer or flash_attn) and bfloat16 and d128" --junitxml="$OUT/conformance.xml"
step 60 python3 benchmarks/bench_attention.py --backends flashinfer,flash_attn --json "$OUT/attention.json"
step 130 python3 benchmarks/gpu_e2e.py --shapes qwen3-0.6b --json "$OUT/e2e.json"
TAIL=8 step 150 python3 benchmarks/bench_graphs.py --backends triton --modes NONE PIECEWISE FULL_AND_PIECEWISE --quick --tpot-batches 1 64 --json "$OUT/graphs.json"
