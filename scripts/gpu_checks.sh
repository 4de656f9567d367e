#!/bin/bash
# The checks that need a GPU, in one device call (carry .whl, made by scripts/gpu_wheels.sh: the device has no network).
# Stage "tests": every CUDA-only test, in parallel processes since Triton's compilation of FLA's kernels
# is what costs (single-threaded per process; the device has 16 cores):
#   exact-<family>  layer-0 exactness with FLA's kernels as shipped, one family per process, IEEE fp32
#                   dots (TRITON_F32_DEFAULT=ieee; Triton fixes a dot's precision when it compiles);
#   exact-ieee-solve-<family>  the same with FLA's TF32-fixed solve dots patched to IEEE (Gated
#                   DeltaNet, KDA), which must happen before anything compiles: a process and cache each;
#   exact-one-config-<family>  the same with each FLA kernel at the first of its own configs, not
#                   autotuned (FLA_CACHE_MODE=default): one compile per kernel instead of 12-36;
#   exact-pytorch   all families with FLA left out (our PyTorch chunked forms on CUDA, no Triton);
#   cuda-engine, fla-gated-delta, fla-kda  the other CUDA-only tests (engine on CUDA, FLA's kernels);
#   serve-cuda      ``hypic serve --device cuda`` end to end against the same server on the CPU, and the
#                   refusal of more CUDA ranks than GPUs.
# Then "profile": torch.profiler breakdown of the all-hit 16 x 1k request; then "bench": the Fig. 12
# sweeps at Qwen3.5-35B-A3B's shapes, 5 timed runs per point. Time limits (s): tests 270, profile 150
# (cold Triton cache: 120 was too short), bench 150; about 590 s in the worst case, so give the device
# call a 600 s limit. Each stage or process has its own limit so a slow one cannot starve the rest.
# Everything lands in $OUT: summary.log (exit codes and tails), machine.txt, bench_real_shapes.json,
# profile_16x1k.txt/.json and results.tar.gz (all logs), refreshed after every stage.
# Stage "baseline" (named in STAGES, with BASELINE=<commit>): the sweeps again with that commit's code.
# Stage "warm" (with "tests"): the profile's run alongside the tests, so that its kernels compile while the
# tests run and the quiet "profile" and "bench" after them find a warm Triton cache (its timings discarded).
# Environment: TESTS_S, PROFILE_S, BENCH_S (limits); STAGES (default tests,profile,bench); LAYERS keeps
# fewer of the model's 40 layers; REPEATS sets the timed runs per mode and shape; FAMILIES and
# SOLVE_FAMILIES narrow the exactness runs, ONE_CONFIG_FAMILIES adds runs at one FLA config per kernel;
# SKIP names test processes to leave out (exact-pytorch,fla-kda).
# One 15-minute lease does not fit every stage with a cold Triton cache: FLA's kernels compiled with IEEE
# fp32 dots take 4-6 minutes per family (Gated DeltaNet, KDA, GLA), several processes at once on one GPU.
# What the H200 lease of 2026-11-28 did: the GLA exactness run at one config per kernel beside
# STAGES=profile,bench,baseline BASELINE=855f656, then baseline and bench again alone (a quiet A/B).
# Stage 1 is done but NCCL, which needs a kind with two GPUs. A call returns at most 8 files from $OUT:
# a second run's OUT inside it comes back only when the first leaves room.
# A CPU dry run of the whole script: DEVICE=cpu PRESET=tiny-moe PROFILE_SHAPE=4x128 BENCH_ARGS=--quick.
set -u
OUT=${OUT:-/tmp/gpu_out}; RES=${RES:-/tmp/gpu_results}; SITE=${SITE:-/tmp/site}; mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=$PWD:$PWD/datasets:$SITE  # the checkout first: its hypic, not an installed one
DEVICE=${DEVICE:-cuda}; PRESET=${PRESET:-qwen3.5-35b-a3b}; LAYERS=${LAYERS:-40}; REPEATS=${REPEATS:-5}
PROFILE_SHAPE=${PROFILE_SHAPE:-16x1024}; BENCH_ARGS=${BENCH_ARGS:-}; STAGES=${STAGES:-tests,profile,bench}
want() { [[ ",$STAGES," == *",$1,"* ]]; }

pack() { cp -f "$RES"/machine.txt "$RES"/bench_real_shapes.json "$RES"/profile_* "$OUT"/ 2>/dev/null
         tar -czf "/tmp/results.$BASHPID.tgz" -C "$RES" . 2>/dev/null && mv -f "/tmp/results.$BASHPID.tgz" "$OUT/results.tar.gz"; }
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$RES/$name.log" 2>&1; local rc=$?
  { echo "stage $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)"; grep -v "Writing model shards" "$RES/$name.log" | tail -n 6; } | tee -a "$OUT/summary.log"
  pack; }

timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl/*.whl >"$RES/install.log" 2>&1 || { cat "$RES/install.log" | tee -a "$OUT/summary.log"; pack; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; lscpu | grep "Model name"
  timeout 60 python3 -c "import sys, torch, triton, fla, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'cuda', torch.version.cuda, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"
  timeout 60 python3 -c "import hypic; print('hypic from', hypic.__file__)"; git log -1 --format='commit %H %s' 2>/dev/null | cut -c1-120
  echo "uncommitted: $(git status --porcelain 2>/dev/null | grep -v '^??' | wc -l) tracked files changed"  # the copy is the working tree
} >"$RES/machine.txt" 2>&1
# Ray's wheel is larger than a device call carries; one-instance serving and the CUDA tests never call it
python3 -c "import ray" 2>/dev/null || { export PYTHONPATH=$PYTHONPATH:$PWD/scripts/ray_stub; echo "ray: the stand-in of scripts/ray_stub" >>"$RES/machine.txt"; }
cat "$RES/machine.txt" | tee -a "$OUT/summary.log"; pack

BENCH="python3 eval/bench_real_shapes.py --device $DEVICE --preset $PRESET --layers $LAYERS --dtype bfloat16"
PYTEST="python3 -m pytest -q -rfEsp -p no:cacheprovider"
EXACT=tests/hypic/test_cuda.py::test_layer0_composition_is_exact_in_fp32_on_cuda
FAMILIES=${FAMILIES-qwen3_5_text-ratio2 kimi_linear hypic_gla minimax granitemoehybrid nemotron_h}  # test_cuda's GPU_KERNEL_FAMILIES
SOLVE_FAMILIES=${SOLVE_FAMILIES-qwen3_5_text-ratio2 kimi_linear}  # test_cuda's FLA_TF32_SOLVE
ONE_CONFIG_FAMILIES=${ONE_CONFIG_FAMILIES-}  # exactness runs with FLA's kernels at one config each (fla_one_config.py)
TESTS_S=${TESTS_S:-270}; SKIP=${SKIP:-}
run_test() { [[ ",$SKIP," == *",$1,"* ]] || stage "$1" "$TESTS_S" "${@:2}"; }  # SKIP: test processes left out
if want tests; then
  for family in $FAMILIES; do  # one family per process: each compiles its own FLA kernels
    ( export TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton_ieee
      run_test "exact-$family" $PYTEST -s "$EXACT[$family]" ) &
  done
  for family in $SOLVE_FAMILIES; do
    ( export TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton_ieee_solve_$family HYPIC_FLA_IEEE_SOLVE=1
      run_test "exact-ieee-solve-$family" $PYTEST -s "${EXACT}_with_fla_solve_in_ieee[$family]" ) &
  done
  for family in $ONE_CONFIG_FAMILIES; do  # FLA's kernels with one config each, not autotuned (GLA: 245 s on an H200, >500 s autotuned)
    ( export TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton_ieee_one_$family FLA_CACHE_MODE=default \
        FLA_CONFIG_DIR=$RES/fla_one_config_$family
      python3 scripts/fla_one_config.py "$FLA_CONFIG_DIR" fla.ops.gla fla.ops.simple_gla fla.ops.kda \
        fla.ops.gated_delta_rule >"$RES/fla_one_config_$family.log" 2>&1
      run_test "exact-one-config-$family" $PYTEST -s "$EXACT[$family]" ) &
  done
  ( run_test exact-pytorch $PYTEST -s "${EXACT}_in_pytorch" ) &
  ( export TRITON_CACHE_DIR=/tmp/triton_bench  # the profile's kernels compile while the tests run: timings discarded;
    # 4 layers (3 Gated DeltaNet, 1 attention) compile the same kernels as 40 in a tenth of the GPU's memory
    want warm && stage warm "$TESTS_S" $BENCH --layers 4 --profile-only "$PROFILE_SHAPE" --profile "$RES/warm" ) &
  export TRITON_CACHE_DIR=/tmp/triton_tests
  ( run_test cuda-engine $PYTEST tests/hypic/test_cuda.py -k "not exact_in_fp32" ) &
  ( run_test fla-gated-delta $PYTEST tests/kernels/test_gated_delta.py -k "gpu" ) &
  ( run_test fla-kda $PYTEST tests/kernels/test_kimi_delta.py -k "gpu" ) &
  ( run_test serve-cuda $PYTEST tests/server/test_serve_cuda.py \
      tests/server/test_serve_tensor_parallel.py::test_what_cannot_be_served_is_refused_before_any_rank_starts ) &
  wait; pack
fi

# Profile and sweeps share a Triton cache (and FLA's cached autotuning), so the second compiles little.
export TRITON_CACHE_DIR=/tmp/triton_bench
want profile && stage profile "${PROFILE_S:-150}" $BENCH --profile-only "$PROFILE_SHAPE" --profile "$RES"
want bench && stage bench "${BENCH_S:-150}" $BENCH --repeats "$REPEATS" --no-progress --json "$RES/bench_real_shapes.json" $BENCH_ARGS
if want baseline; then  # the same sweeps with BASELINE's code, on this machine: an A/B, not two leases
  git worktree add -f /tmp/baseline "${BASELINE:?STAGES=baseline needs BASELINE=<commit>}" >"$RES/baseline-checkout.log" 2>&1
  ( cd /tmp/baseline && PYTHONPATH=/tmp/baseline:/tmp/baseline/datasets:$SITE:$PWD/scripts/ray_stub \
      stage baseline "${BENCH_S:-150}" python3 eval/bench_real_shapes.py --device "$DEVICE" --preset "$PRESET" \
      --layers "$LAYERS" --dtype bfloat16 --repeats "$REPEATS" --no-progress --json "$RES/baseline_real_shapes.json" $BENCH_ARGS )
  cp -f "$RES/baseline_real_shapes.json" "$OUT/" 2>/dev/null
  git worktree remove --force /tmp/baseline >>"$RES/baseline-checkout.log" 2>&1
fi
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$RES/machine.txt" 2>&1; pack
echo "done in $SECONDS s" | tee -a "$OUT/summary.log"
