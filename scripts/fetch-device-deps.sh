#!/usr/bin/env bash
# On a machine with package-index access: download the pure-Python packages that an offline GPU image
# lacks (CPython 3.12 manylinux wheels) into .device-deps/. Copy that folder with the tree to the offline
# machine, where scripts/device-setup.sh installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.device-deps/' .git/info/exclude 2>/dev/null || echo '/.device-deps/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device-deps "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection gguf  # a matching pair
# `turnout serve` and `turnout bench serve` (the image has h11, click, httpx, prometheus-client)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device-deps fastapi starlette opentelemetry-api anyio uvicorn openai httpx2 httpcore2 truststore jiter sniffio \
  pyzmq msgpack
# structured outputs (the image has transformers, numpy and typing-extensions)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device-deps "xgrammar==0.2.9" apache-tvm-ffi
ls .device-deps
