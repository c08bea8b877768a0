#!/usr/bin/env bash
# The device-side all-gather checks on one GPU node, one PASS/FAIL line per step.
#
#   bash launch/run_ipc_check.sh            # 2 and 4 ranks (they may share one GPU)
#   RANKS="2 4 8" bash launch/run_ipc_check.sh
#   MPIRUN="mpirun --allow-run-as-root --oversubscribe" PYTHON=python bash launch/run_ipc_check.sh
#
# Steps per rank count N: launch/ipc_check.py (transport checks, one line each;
# see its docstring), then the main job launch/exchange.py --transport ipc
# --graph (eager and captured exchange, EXACT against the unsharded oracle).
# Every step runs under `timeout` (STEP_TIMEOUT seconds, default 900) so a
# hang shows up as a FAIL instead of a stuck job. Logs: $LOG_DIR (default
# out/ipc_check). Exit status: the number of failed steps (0: all passed).
set -u
cd "$(dirname "$0")/.."
MPIRUN=${MPIRUN:-mpirun --allow-run-as-root --oversubscribe}
PYTHON=${PYTHON:-python}
RANKS=${RANKS:-2 4}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
LOG_DIR=${LOG_DIR:-out/ipc_check}
mkdir -p "$LOG_DIR"
failed=0

step() {  # step NAME LOG COMMAND...
    local name=$1 log=$2
    shift 2
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    if [ $rc -eq 0 ]; then
        echo "PASS  $name  (${took}s, log $log)"
    else
        [ $rc -eq 124 ] && why="timed out after ${STEP_TIMEOUT}s" || why="exit $rc"
        echo "FAIL  $name  ($why, ${took}s, log $log)"
        failed=$((failed + 1))
    fi
    return $rc
}

for n in $RANKS; do
    log="$LOG_DIR/ipc_check-n$n.log"
    step "ipc_check -n $n" "$log" $MPIRUN -n "$n" "$PYTHON" launch/ipc_check.py
    grep -E '^(PASS|FAIL|SKIP) ' "$log" | sed 's/^/      /'
    for extra in "" "--sparse-table --merge owned"; do
        log="$LOG_DIR/exchange-n$n${extra:+-table-owned}.log"
        step "exchange.py -n $n --transport ipc --graph $extra" "$log" \
            $MPIRUN -n "$n" "$PYTHON" launch/exchange.py --transport ipc --graph $extra \
            --json "$LOG_DIR/exchange-n$n${extra:+-table-owned}.json"
        grep -E '^(transport|EXACT|INEXACT)|graph_replay|all_gather' "$log" | sed 's/^/      /'
    done
done
echo "run_ipc_check: $failed step(s) failed"
exit $failed
