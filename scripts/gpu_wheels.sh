#!/bin/bash
# The wheels the GPU machine lacks, downloaded here into .whl/ (git-ignored) for a device call to carry:
# FLA, and the HTTP server's stack (fastapi needs opentelemetry-api). The machine's image has torch,
# Triton, transformers, numpy, safetensors, tokenizers, xxhash, httpx, jinja2 and pytest; not Ray,
# whose wheel is larger than a call carries (gpu_checks.sh then takes scripts/ray_stub).
set -eu
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  flash-linear-attention==0.6.0 fla-core==0.6.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 \
  pydantic_core==2.46.4 uvicorn==0.54.0 typing-inspection==0.4.2 annotated-types==0.7.0 opentelemetry-api==1.45.2
du -sh .whl
