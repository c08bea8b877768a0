#!/usr/bin/env bash
# The one-GPU kernel run: what BENCHMARKS.md's kernel tables report, in one command, with
# the raw output and the command of each step written under OUT_DIR.
#
#   bash benchmarks/gpu_kernels.sh [OUT_DIR]               on a node with a GPU
#   STEPS="facts kernels sweep" bash benchmarks/gpu_kernels.sh out/h200
#
# Steps, in order (STEPS picks some):
#   facts    the commit, the date, the GPU and its driver, the package's backend line
#   kernels  bench_kernels.py --exchange: device, eager and host µs of cases a-g, world 1
#            in one kernel, ratios to the reference kernels, every output checked
#   sweep    bench_kernels.py --sweep-launch --no-torch: every launch shape, pack, merge
#            and world 1
#   host     profile_call.py --torch: host µs of a call with CuPy arrays and tensors
#            (needs PyTorch)
#   ncu      Nsight Compute of the small rows' kernels (NVIDIA, where ncu is found)
#   tests    the kernel, launch and caller tests on the GPU target
#
# Each step runs under `timeout STEP_TIMEOUT` (the sweep, which compiles a kernel per
# shape, under SWEEP_TIMEOUT, and the tests under TESTS_TIMEOUT) and writes
# OUT_DIR/<step>.txt, its command first; a failed step is reported and the next one runs.
# The exit status is 1 if any step failed. PYTHON names the interpreter.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out/gpu-kernels}
PYTHON=${PYTHON:-python3}
ALL_STEPS="facts kernels sweep host ncu tests"
STEPS=${STEPS:-$ALL_STEPS}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-1800}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-1800}
export NUMBA_CP_BACKEND=${NUMBA_CP_BACKEND:-cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for step in $STEPS; do
  case " $ALL_STEPS " in
    *" $step "*) ;;
    *) echo "unknown step '$step' (steps: $ALL_STEPS)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
failed=0

run() {  # run STEP LIMIT_S COMMAND...: the command and its output in OUT/STEP.txt
  local step=$1 limit=$2 log="$OUT/$1.txt"
  shift 2
  { echo "\$ NUMBA_CP_BACKEND=$NUMBA_CP_BACKEND $*"; echo; } >"$log"
  if timeout "$limit" "$@" >>"$log" 2>&1; then
    echo "PASS  $step ($log)"
  else
    echo "FAIL  $step (exit $?; $log)"
    failed=1
  fi
}

facts() {
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
       "$(git status --porcelain 2>/dev/null | grep -q . && echo '(with local changes)')"
  date -u '+%Y-%m-%d %H:%M UTC'
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  elif command -v rocm-smi >/dev/null; then
    rocm-smi --showproductname --showdriverversion
  fi
  "$PYTHON" -c "import numba_cp; print(numba_cp.backend.describe())"
}

for step in $STEPS; do
  case $step in
    facts)
      if facts >"$OUT/facts.txt" 2>&1; then
        echo "PASS  facts ($OUT/facts.txt)"
      else
        echo "FAIL  facts ($OUT/facts.txt)"
        failed=1
      fi ;;
    kernels) run kernels "$STEP_TIMEOUT" "$PYTHON" benchmarks/bench_kernels.py --exchange \
               --json "$OUT/bench_kernels.json" ;;
    sweep) run sweep "$SWEEP_TIMEOUT" "$PYTHON" benchmarks/bench_kernels.py --sweep-launch \
             --no-torch --rounds 1 --json "$OUT/bench_kernels_sweep.json" ;;
    host) run host "$STEP_TIMEOUT" "$PYTHON" benchmarks/profile_call.py --torch \
            --json "$OUT/profile_call.json" ;;
    ncu)
      if command -v ncu >/dev/null; then
        run ncu "$STEP_TIMEOUT" env PYTHON="$PYTHON" bash benchmarks/ncu_small_rows.sh a,b,g
      else
        echo "SKIP  ncu (no ncu on PATH)"
      fi ;;
    tests) run tests "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider -rfE \
             tests/test_local_topk.py tests/test_merge.py tests/test_exactness.py \
             tests/test_primitives.py tests/test_chained_launch.py tests/test_launch_cache.py \
             tests/test_torch_callers.py ;;
  esac
done
exit $failed
