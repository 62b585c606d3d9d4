#!/usr/bin/env bash
# On a GPU machine without a package index whose image already holds torch and triton: install the few
# pure-Python dependencies it lacks from wheels in .device-deps/ (scripts/fetch-device-deps.sh downloads
# them), then the core and every plugin, editable and without touching the image's torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --find-links .device-deps pydantic gguf 2>&1 | grep -v WARNING || true
python3 -m pip install -q --no-index --find-links .device-deps fastapi uvicorn openai pyzmq msgpack xgrammar 2>&1 | grep -v WARNING || true
args=(-e .)
for p in plugins/*/*/; do args+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${args[@]}" 2>&1 | grep -v -i warning || true
python3 -c 'import turnout, torch; print("turnout ok, torch", torch.__version__, "cuda", torch.cuda.is_available())'
