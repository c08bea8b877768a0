#!/usr/bin/env bash
# Run the test suite, setting up this machine's environment first if needed.
#   bash tests/run.sh [pytest args]
# The environment is the one launch/run_exchange.sh uses (.venv-<stack>, built by
# launch/setup_env.sh with the test extra and MPICH from PyPI; rebuilt only when
# pyproject.toml changes). The tests run on the CPU simulator on any machine;
# NUMBA_CP_BACKEND=cuda runs the same suite on an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh  # also puts the mpiexec that matches this mpi4py first on PATH
exec "$VENV/bin/python" -m pytest "$@"
