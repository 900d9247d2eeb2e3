#!/usr/bin/env bash
# The wheels the device scripts carry (`carry=[".whl"]`; preamble.sh installs them on the machine, whose image has
# torch, triton, pytest, numpy, safetensors, jinja2 and pillow but not these). A fresh checkout has no .whl/:
#   bash lab/device/wheels.sh     # ~18 MB, cp312 manylinux, the versions of this machine's .venv
# compressed-tensors is left out on purpose (its deps: pydantic, loguru, psutil): keep tests/backend/quant/ out of device runs; never huggingface_hub 2.x (needs httpx2).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
for spec in msgspec==0.23.0 pytest-asyncio==1.5.0 llguidance==1.9.1 regex==2026.12.2 tokenizers==0.23.3 \
    transformers==5.24.0 starlette==1.10.0 uvicorn==0.55.0 structlog==26.1.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$spec"
done
ls .whl
