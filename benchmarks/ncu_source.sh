#!/usr/bin/env bash
# Nsight Compute per SASS instruction of one small-row kernel: executions and warp-stall
# samples, as CSV (summarize it with benchmarks/ncu_source_summary.py).
#   NUMBA_CP_BACKEND=cuda bash benchmarks/ncu_source.sh CASE KERNEL_REGEX OUT.csv [method] [arrays]
#   e.g. ... ncu_source.sh g merge_topk_ids_and_table_addressed g.csv
#        ... ncu_source.sh g merge_topk_ids_and_table g_arrays.csv auto arrays
#        ... ncu_source.sh b shard_topk_keys b_arrays.csv auto arrays
# "arrays": the pack and merge + table with Numba's array parameters (addressed=False)
# instead of the default, their arrays by address.
# Profiles the second launch that profile_kernels.py's `launch` makes of the kernel.
# --cache-control none and --clock-control none: no cache flush before the launch, and
# the GPU's own clocks, nearer a graph replay than the profiler's defaults (a flush
# turns the first constant and instruction fetches into misses).
set -euo pipefail
cd "$(dirname "$0")/.."
case_name=$1
kernel=$2
out=$3
method=${4:-auto}
addressed=()
case ${5:-} in
  "") ;;
  arrays) addressed=(--addressed off) ;;
  *) echo "ncu_source.sh: the fifth argument is 'arrays' or nothing, got '$5'" >&2; exit 2 ;;
esac
report=$(mktemp -d)/source
ncu --cache-control none --clock-control none -k "regex:$kernel" --launch-skip 1 \
  --launch-count 1 --section SourceCounters --section WarpStateStats -o "$report" \
  python3 benchmarks/profile_kernels.py launch --cases "$case_name" --method "$method" \
  "${addressed[@]}"
ncu -i "$report.ncu-rep" --page source --csv --print-source sass > "$out"
