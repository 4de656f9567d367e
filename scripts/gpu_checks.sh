#!/bin/bash
# The checks that need a GPU, in one device call (batched prefill; host memory below the GPU's public
# pool, L2): FLA's wheels from .whl, hypic installed without its dependencies (the image's torch and
# transformers), then the CUDA tests and the batched-prefill benchmark, each stage under its own
# time limit so a slow one cannot starve the rest. Results under $OUT.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep "Model name";
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"; } \
  | tee "$OUT/machine.txt"
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "stage $name: rc $? in $((SECONDS - t0)) s"; tail -n 4 "$OUT/$name.log"; }
stage tests "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -x tests/hypic/test_cuda.py tests/kernels/test_gated_delta.py -k "cuda or varlen or fla"
stage shipped "${SHIPPED_S:-200}" python3 eval/bench_batched_prefill.py --device cuda --repeats 5 --json "$OUT/batched_shipped_cuda.json"
stage real "${REAL_S:-150}" python3 eval/bench_batched_prefill.py --device cuda --preset qwen3.5-35b-a3b --layers 8 \
  --dtype bfloat16 --repeats 3 --json "$OUT/batched_qwen35_8layers_cuda.json"
