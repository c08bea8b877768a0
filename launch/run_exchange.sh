#!/usr/bin/env bash
# Set up an environment for this machine (once) and run the main job under MPI.
#   bash launch/run_exchange.sh [exchange.py args]      e.g. --context 32K --json out.json
# NP ranks (default 4). The stack follows the hardware: an NVIDIA GPU gets
# numba-cuda + cupy-cuda13x, an AMD GPU numba-hip + cupy-rocm-7-0 (its own venv),
# anything else the CPU simulator. MPI: MPICH from PyPI, unless NUMBA_CP_MPI=site,
# which builds mpi4py against the mpicc on PATH (a cluster's CUDA/ROCm-aware MPI).
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
PYTHON=${PYTHON:-python3}
if [ -e /dev/kfd ] && command -v rocminfo >/dev/null 2>&1; then
  stack=rocm; extras=rocm
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  stack=cuda; extras=cuda
else
  stack=sim; extras=sim
fi
if [ "${NUMBA_CP_MPI:-pypi}" = site ]; then extras="$extras,mpi"; else extras="$extras,mpich"; fi
VENV=${VENV:-.venv-$stack}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if [ "$stack" = rocm ]; then pins="numpy<2.4"; else pins="numpy<2.5"; fi
"$VENV/bin/python" -m pip install -q -e ".[$extras]" "$pins"
export PATH="$PWD/$VENV/bin:$PATH"
if [ "$(id -u)" = 0 ] && mpiexec --version 2>/dev/null | grep -qi "open mpi"; then
  root_flags="--allow-run-as-root --oversubscribe"
else
  root_flags=""
fi
# NVLink multicast stays off in anything this job starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec mpiexec $root_flags -n "$NP" "$VENV/bin/python" launch/exchange.py "$@"
