#!/usr/bin/env bash
# Nsight Compute over the small-row cases' pack and merge kernels (a, b, g by default):
# instructions executed, duration and the warp stall reasons, per kernel launch.
#   NUMBA_CP_BACKEND=cuda bash benchmarks/ncu_small_rows.sh [cases [method]] > ncu.txt
# Instructions per row = smsp__inst_executed.sum / (rows x heads x warps per row).
# --clock-control none: the GPU keeps its own clocks, as in the timed benchmarks.
# PYTHON names the interpreter (python3 unless set).
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-a,b,g}
method=${2:-auto}
exec ncu --clock-control none -k 'regex:shard_topk|merge_topk' --launch-skip 4 --launch-count 12 \
  --metrics smsp__inst_executed.sum,gpu__time_duration.sum,smsp__cycles_active.avg,\
smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,\
smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,\
smsp__warp_issue_stalled_wait_per_warp_active.pct,\
smsp__warp_issue_stalled_barrier_per_warp_active.pct,\
smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct \
  "${PYTHON:-python3}" benchmarks/profile_kernels.py launch --cases "$cases" --method "$method"
