#!/usr/bin/env bash
# Compile every kernel for NVIDIA GPUs (sm_90 PTX, and SASS for the IPC kernels) on a
# machine with no GPU, in an environment of its own.
#   bash tools/ptx_compile_check.sh                      python -m numba_cp.compile_check --cc 9.0
#   bash tools/ptx_compile_check.sh -c 'python code'     any python arguments instead
#
# Builds .venv-ptx-check/ (VENV) once: numba-cuda[cu13] as pyproject.toml's cuda extra
# pins it, which brings the CUDA toolkit's NVVM and nvJitLink (about 0.5 GB of NVIDIA
# wheels that the CPU-only environment leaves out), and numpy. numba_cp runs from this
# checkout (PYTHONPATH). Exit status 3: the wheels could not be fetched, nothing compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-ptx-check}
PYTHON=${PYTHON:-python3}
numba_cuda=$(grep -o '"numba-cuda\[cu13\][^"]*"' pyproject.toml | tr -d '"')
numpy=$(grep -o '"numpy[^"]*"' pyproject.toml | head -1 | tr -d '"')
wanted="$numba_cuda $numpy"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.numba_cp-setup" 2>/dev/null)" != "$wanted" ]; then
  echo "ptx_compile_check: building $VENV ($wanted)" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$numba_cuda" "$numpy"; then
    echo "ptx_compile_check: could not install $wanted" >&2
    exit 3
  fi
  printf '%s\n' "$wanted" > "$VENV/.numba_cp-setup"
fi
unset NUMBA_ENABLE_CUDASIM
export NUMBA_CP_BACKEND=cuda NUMBA_CP_COMPILE_ONLY=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -eq 0 ]; then set -- -m numba_cp.compile_check --cc 9.0; fi
exec "$VENV/bin/python" "$@"
