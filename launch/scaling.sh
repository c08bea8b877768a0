#!/usr/bin/env bash
# The multi-GPU scaling run: one rank per GPU, every transport, eager and graph-replayed,
# for the benchmark cases of BENCHMARKS.md, then the scaling sweeps, then the tables.
#
#   bash launch/scaling.sh [OUT_DIR]           on a node with 2, 4 or 8 GPUs
#   WORLDS="2 4" TRANSPORTS="staged ipc" bash launch/scaling.sh
#   DRY=1 WORLDS="1 2" TRANSPORTS=host bash launch/scaling.sh   CPU dry run (simulator, tiny shapes)
#
# The two-level exchange (--hierarchy node) runs for LEVEL_CASES at every world of at
# least two ranks per node. On one node it pretends LEVEL_NODES nodes (NUMBA_CP_NODES);
# LEVEL_NODES="" takes the real nodes of a multi-node job.
#
# Each step: launch/exchange.py --graph --json, under `timeout`; a failed step is logged
# and skipped. Then launch/scaling_table.py prints the tables and draws the plots.
# NVLink multicast stays off for everything started here.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out/scaling}
WORLDS=${WORLDS:-"2 4 8"}
TRANSPORTS=${TRANSPORTS:-"staged ipc nccl"}
CASES=${CASES:-"a b c d e f g"}
MPIRUN=${MPIRUN:-mpirun}
PYTHON=${PYTHON:-python3}
ITERS=${ITERS:-50}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
LEVEL_CASES=${LEVEL_CASES:-"b e"}
LEVEL_NODES=${LEVEL_NODES-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"

case_args() {  # the cases of BENCHMARKS.md; DRY=1 shrinks them for the simulator
  local args
  case $1 in
    a) args="--context 32K --topk 16 --batch 64" ;;
    b) args="--context 128K --topk 16 --batch 64" ;;
    c) args="--context 128K --topk 32 --batch 64 --query-len 4" ;;
    d) args="--context 512K --topk 64 --batch 64" ;;
    e) args="--context 1M --topk 128 --batch 32" ;;
    f) args="--context 128K --topk 16 --batch 256" ;;
    g) args="--context 128K --topk 32 --batch 64 --heads 1 --sparse-table" ;;
    *) echo "unknown case $1" >&2; return 1 ;;
  esac
  if [ "${DRY:-0}" = 1 ]; then
    args=$(echo "$args" | sed -E 's/--context [0-9]+[KM]/--context 4K/; s/--batch [0-9]+/--batch 2/;
                                   s/--topk [0-9]+/--topk 8/')
  fi
  echo "--heads 4 $args"  # a later --heads (case g) wins
}

run() {  # run NAME WORLD ARGS...
  local name=$1 world=$2
  shift 2
  local log="$OUT/$name.log"
  if timeout "$STEP_TIMEOUT" $MPIRUN -n "$world" "$PYTHON" launch/exchange.py "$@" \
       --json "$OUT/$name.json" >"$log" 2>&1; then
    echo "PASS  $name"
  else
    echo "FAIL  $name (log $log)"
  fi
}

iters="--iters $ITERS --warmup 5"
[ "${DRY:-0}" = 1 ] && iters="--iters 1 --warmup 0 --replays 1"
for world in $WORLDS; do
  for transport in $TRANSPORTS; do
    for c in $CASES; do
      run "case-$c-w$world-$transport" "$world" $(case_args "$c") --transport "$transport" \
          --graph $iters
    done
  done
done

# The two-level exchange beside the flat runs above (transport "two-level" in the tables).
forward=""  # Open MPI passes on only the variables -x names
$MPIRUN --version 2>/dev/null | grep -qi "open mpi" && forward="-x NUMBA_CP_NODES"
for world in $WORLDS; do
  if [ -n "$LEVEL_NODES" ] && [ "$world" -lt $((2 * LEVEL_NODES)) ]; then continue; fi
  for c in $LEVEL_CASES; do
    NUMBA_CP_NODES="$LEVEL_NODES" MPIRUN="$MPIRUN $forward" \
      run "case-$c-w$world-two-level" "$world" $(case_args "$c") --hierarchy node \
          --graph $iters
  done
done

# Scaling at a fixed world (the largest asked for): context 32K -> 1M, default transport.
largest=$(echo "$WORLDS" | tr ' ' '\n' | sort -n | tail -1)
contexts="32K,128K,512K,1M"
[ "${DRY:-0}" = 1 ] && contexts="2K,4K"
run "sweep-context-w$largest" "$largest" $(case_args b | sed -E 's/--context [0-9]+[KM]//') \
    --sweep-context "$contexts" --graph $iters
# Scaling at a fixed context (case b): world 1 (the whole top-k on one GPU) -> the largest.
for world in $(printf "%s\n" 1 $WORLDS | sort -nu); do
  run "sweep-world-w$world" "$world" $(case_args b) --graph $iters
done

"$PYTHON" launch/scaling_table.py "$OUT"
