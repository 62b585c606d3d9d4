#!/usr/bin/env bash
# Async scheduling on one H200, in one call of under 10 minutes:
#   1. tests/test_async_scheduling.py on CUDA: async equals sync with graphs, and a steady decode step makes
#      no stream or device sync (torch.cuda sync debug mode "error");
#   2. GPU idle time between decode steps at batch 256, async off and on (benchmarks/gpu_idle.py);
#   3. nano-vllm's bench (shared/peers/nanobench.py) with TURNOUT_ASYNC_SCHEDULING=0 and =1.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state.
set -u
W=/tmp/workasync
source benchmarks/device_prologue.sh
echo "== tests on CUDA ($SECONDS s)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py -rf > "$W/tests.log" 2>&1
grep -E "^FAILED|passed|failed" "$W/tests.log" | tail -4
CKPT=$W/qwen3-0.6b
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from random_models import make_random_model; make_random_model(Path('$CKPT'), 'qwen3-0.6b')"
echo "== GPU idle between decode steps, batch 256 ($SECONDS s)"
timeout 200 python3 benchmarks/gpu_idle.py --model "$CKPT" --json "$OUT/gpu_idle.json" > "$W/idle.log" 2>&1
quiet "$W/idle.log" | tail -4
NB=$(ls shared/peers/nanobench.py ../shared/peers/nanobench.py .peer/nanobench.py 2>/dev/null | head -1)
for a in 0 1; do
  echo "== nanobench, TURNOUT_ASYNC_SCHEDULING=$a ($SECONDS s)"
  TURNOUT_ASYNC_SCHEDULING=$a timeout $(( (580 - SECONDS) / (2 - a) )) python3 "$NB" turnout "$CKPT" 2>&1 | grep RESULT
done
cp "$W/tests.log" "$W/idle.log" "$OUT/"
echo "== done ($SECONDS s)"
