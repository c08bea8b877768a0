#!/usr/bin/env bash
# Run the main job under MPI, setting up this machine's environment first if needed.
#   bash launch/run_exchange.sh [options]      e.g. --context 32K --json out.json (--help)
# The environment (.venv-<stack>, shared with tests/run.sh) is built on the first run and
# rebuilt only when pyproject.toml changes (launch/setup_env.sh); later runs install
# nothing and need no network. NP ranks (default 4). The stack follows the hardware: an
# NVIDIA GPU gets numba-cuda + CuPy (CUDA 13, or 12 for an older driver), an AMD GPU
# numba-hip + cupy-rocm-7-0 (ROCm 7), anything else the CPU simulator. MPI: MPICH from
# PyPI and its mpiexec; NUMBA_CP_MPI=site builds mpi4py against the site MPI's mpicc and
# starts the ranks with the site's launcher (MPIEXEC, else srun inside a Slurm
# allocation, else the mpiexec beside mpicc).
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
source launch/setup_env.sh
if [ -n "${MPIEXEC:-}" ]; then
  read -r -a launcher <<< "$MPIEXEC"
elif [ "$MPI_KIND" = pypi ]; then
  launcher=("$VENV/bin/mpiexec")
elif [ -n "${SLURM_JOB_ID:-}" ] && command -v srun >/dev/null 2>&1; then
  launcher=(srun)
elif [ -x "$(dirname "$SITE_MPICC")/mpiexec" ]; then
  launcher=("$(dirname "$SITE_MPICC")/mpiexec")
else
  launcher=(mpiexec)
fi
if [ "$(id -u)" = 0 ] && "${launcher[0]}" --version 2>/dev/null | grep -qi "open mpi"; then
  launcher+=(--allow-run-as-root --oversubscribe)
fi
# NVLink multicast stays off in anything this job starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "${launcher[@]}" -n "$NP" "$VENV/bin/python" -m numba_cp.main_job "$@"
