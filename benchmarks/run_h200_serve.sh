#!/usr/bin/env bash
# `turnout serve` on one H200, in one call:
#   1. nano-vllm's bench workload (256 requests, lengths uniform in [100, 1024], temperature 0.6,
#      ignore_eos, seed 0) through the server with the openai async client at full concurrency, streamed
#      and not, then offline LLM.generate on the same workload in the same process: output tok/s and the
#      ratio server / offline (the target is >= 0.9);
#   2. the same workload at request rates 8, 32 and inf: TTFT, TPOT and ITL at p50 and p99.
# Pass BENCH_COMMIT=<this commit> in the command: the device copy has no true git state. Carry .device-deps
# (scripts/fetch-device-deps.sh: FastAPI, uvicorn and openai are not on the image).
set -u
W=/tmp/workserve
source benchmarks/device_prologue.sh
CKPT=$W/qwen3-0.6b
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from random_models import make_random_model; make_random_model(Path('$CKPT'), 'qwen3-0.6b')"
BENCH="python3 -m turnout.cli bench serve $CKPT --workload nanovllm --max-model-len 4096"
echo "== server vs offline ($SECONDS s)"
timeout 400 $BENCH --vs-offline --repeat 2 --output "$OUT/serve_vs_offline.json" > "$W/vs.log" 2>&1
quiet "$W/vs.log" | grep -E "^----|completed|failed|output_throughput|_p50_ms|_p99_ms|offline|rror" | cut -c1-200
echo "== request rates ($SECONDS s)"
timeout $((585 - SECONDS)) $BENCH --request-rate 8 32 inf --output "$OUT/serve_rates.json" > "$W/rates.log" 2>&1
quiet "$W/rates.log" | grep -E "^----|completed|failed|output_throughput|_p50_ms|_p99_ms|rror" | cut -c1-200
tar czf "$OUT/logs_serve.tar.gz" -C "$W" --exclude qwen3-0.6b .
