#!/usr/bin/env bash
# Set up a virtual environment with the test extra (once) and run the test suite.
#   bash tests/run.sh [pytest args]
# VENV picks the environment folder (default .venv). Runs on the CPU simulator
# on any machine; NUMBA_CP_BACKEND=cuda runs the same suite on an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# numba-cuda 0.30 breaks on numpy 2.5 (np.row_stack is gone)
"$VENV/bin/python" -m pip install -q -e ".[test]" "numpy<2.5"
export PATH="$PWD/$VENV/bin:$PATH"  # the mpiexec that matches this mpi4py
exec "$VENV/bin/python" -m pytest "$@"
