#!/usr/bin/env bash
# Here, with registry access: download the pure-Python packages the offline GPU machine's image lacks
# (cp312 wheels) into .device-deps/, which scripts/device-setup.sh installs there. Carry .device-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.device-deps/' .git/info/exclude 2>/dev/null || echo '/.device-deps/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device-deps "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection gguf  # a matching pair
# `turnout serve` and `turnout bench serve` (the image has h11, click, httpx, prometheus-client)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device-deps fastapi starlette opentelemetry-api anyio uvicorn openai httpx2 httpcore2 truststore jiter sniffio
ls .device-deps
