#!/bin/bash
# The checks that need a GPU, in one device call: every CUDA-only test (layer-0 exactness in IEEE
# fp32 for each family with a GPU kernel in its own process, since Triton picks a dot's precision
# when it compiles), then a torch.profiler breakdown of the all-hit 16 x 1k request, then the
# Fig. 12 sweeps at Qwen3.5-35B-A3B's shapes. Each stage has its own time limit (install 30 s, the
# two test stages 110 side by side, profile 120, sweeps 140: 400 s) so a slow one cannot starve the
# rest; the profile runs before the sweeps for the same reason.
# FLA comes from the wheels in .whl (the device has no network). Everything lands in $OUT:
# summary.log (stage exit codes and tails), machine.txt, bench_real_shapes.json, profile_16x1k.txt
# and results.tar.gz (all logs and JSON), refreshed after every stage.
# Time limits (seconds) can be changed from the environment: EXACT_S, TESTS_S, PROFILE_S, BENCH_S;
# LAYERS keeps fewer of the model's 40 layers, REPEATS sets the timed runs per mode and shape.
# STAGES picks stages (default tests,profile,bench; a rerun after the tests passed: STAGES=profile,bench).
# A CPU dry run of the whole script: DEVICE=cpu PRESET=tiny-moe PROFILE_SHAPE=4x128 BENCH_ARGS=--quick.
set -u
OUT=${OUT:-/tmp/gpu_out}; RES=${RES:-/tmp/gpu_results}; SITE=${SITE:-/tmp/site}; mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=$PWD:$PWD/datasets:$SITE  # the checkout first: its hypic, not an installed one
DEVICE=${DEVICE:-cuda}; PRESET=${PRESET:-qwen3.5-35b-a3b}; LAYERS=${LAYERS:-40}; REPEATS=${REPEATS:-5}
PROFILE_SHAPE=${PROFILE_SHAPE:-16x1024}; BENCH_ARGS=${BENCH_ARGS:-}; STAGES=${STAGES:-tests,profile,bench}
want() { [[ ",$STAGES," == *",$1,"* ]]; }

pack() { cp -f "$RES"/machine.txt "$RES"/bench_real_shapes.json "$RES"/profile_*.txt "$OUT"/ 2>/dev/null
         tar -czf "/tmp/results.$BASHPID.tgz" -C "$RES" . 2>/dev/null && mv -f "/tmp/results.$BASHPID.tgz" "$OUT/results.tar.gz"; }
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$RES/$name.log" 2>&1; local rc=$?
  { echo "stage $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)"; tail -n 6 "$RES/$name.log"; } | tee -a "$OUT/summary.log"
  pack; }

timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl/*.whl >"$RES/install.log" 2>&1 || { cat "$RES/install.log" | tee -a "$OUT/summary.log"; pack; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; lscpu | grep "Model name"
  timeout 60 python3 -c "import sys, torch, triton, fla, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'cuda', torch.version.cuda, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"
  timeout 60 python3 -c "import hypic; print('hypic from', hypic.__file__)"; git log -1 --format='commit %H %s' 2>/dev/null | cut -c1-120
} >"$RES/machine.txt" 2>&1
cat "$RES/machine.txt" | tee -a "$OUT/summary.log"; pack

# The two test stages run side by side (correctness only, tiny models), each with its own Triton cache:
# the exact stage's kernels must be compiled with IEEE fp32 dots, never taken from a TF32 build.
PYTEST="python3 -m pytest -q -rfEsp -p no:cacheprovider"
if want tests; then
  ( export TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton_ieee
    stage exact "${EXACT_S:-110}" $PYTEST -s tests/hypic/test_cuda.py -k exact_in_fp32 ) &
  ( export TRITON_CACHE_DIR=/tmp/triton_tests
    stage tests "${TESTS_S:-110}" $PYTEST tests/hypic/test_cuda.py tests/kernels -k "not exact_in_fp32" ) &
  wait; pack
fi

# Profile and sweeps share a Triton cache (and FLA's cached autotuning), so the second compiles little.
export TRITON_CACHE_DIR=/tmp/triton_bench
BENCH="python3 eval/bench_real_shapes.py --device $DEVICE --preset $PRESET --layers $LAYERS --dtype bfloat16"
want profile && stage profile "${PROFILE_S:-120}" $BENCH --profile-only "$PROFILE_SHAPE" --profile "$RES"
want bench && stage bench "${BENCH_S:-140}" $BENCH --repeats "$REPEATS" --no-progress --json "$RES/bench_real_shapes.json" $BENCH_ARGS
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$RES/machine.txt" 2>&1; pack
echo "done in $SECONDS s" | tee -a "$OUT/summary.log"
