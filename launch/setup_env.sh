# Sourced by launch/run_exchange.sh and tests/run.sh, from the repository root: the one
# environment of this machine's stack, which both commands share. It is built when it is
# missing or when what it was built from changed (pyproject.toml, the stack, the MPI, the
# checkout's folder); otherwise nothing is installed and nothing touches the network.
#
# Sets STACK (sim, cuda, cuda12 or rocm), VENV, MPI_KIND (pypi or site) and puts
# $VENV/bin first on PATH. Knobs:
#   NUMBA_CP_STACK=sim|cuda|cuda12|rocm  override the stack picked from the hardware
#   NUMBA_CP_MPI=site   build mpi4py from source against the site MPI's mpicc (MPICC, else
#                       the mpicc on PATH) instead of MPICH from PyPI; the site's launcher runs
#   VENV=<folder>       the environment (default .venv-<stack>, .venv-<stack>-site-mpi)
#   PYTHON=python3      the interpreter the environment is made from

_setup_fail() { echo "setup: $*" >&2; exit 2; }

_detect_stack() {
  if [ -e /dev/kfd ] && command -v rocminfo >/dev/null 2>&1; then
    echo rocm
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # cupy-cuda13x and the CUDA 13 toolkit wheels need a CUDA 13 driver
    local driver
    driver=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -1)
    if [ -n "$driver" ] && [ "$driver" -lt 13 ]; then echo cuda12; else echo cuda; fi
  else
    echo sim
  fi
}

# cupy-rocm-7-0 loads the ROCm 7 runtime; with an older ROCm the job fails only at its
# first GPU call, so say so before building anything.
_require_rocm7() {
  local root=${ROCM_PATH:-/opt/rocm}
  if [ -e "$root/lib/libamdhip64.so.7" ] || ldconfig -p 2>/dev/null | grep -q 'libamdhip64\.so\.7'; then
    return 0
  fi
  _setup_fail "the AMD stack (cupy-rocm-7-0) needs the ROCm 7 runtime (libamdhip64.so.7), not" \
              "found in $root/lib or the loader's path: load a ROCm 7 module or set ROCM_PATH"
}

STACK=${NUMBA_CP_STACK:-$(_detect_stack)}
case "$STACK" in sim|cuda|cuda12|rocm) ;; *) _setup_fail "NUMBA_CP_STACK=$STACK: expected sim, cuda, cuda12 or rocm" ;; esac
MPI_KIND=${NUMBA_CP_MPI:-pypi}
case "$MPI_KIND" in pypi|site) ;; *) _setup_fail "NUMBA_CP_MPI=$MPI_KIND: expected site (or unset: MPICH from PyPI)" ;; esac
if [ "$MPI_KIND" = site ]; then
  SITE_MPICC=${MPICC:-$(command -v mpicc || true)}
  [ -n "$SITE_MPICC" ] || _setup_fail "NUMBA_CP_MPI=site builds mpi4py with the site MPI's mpicc," \
                                      "but there is none on PATH (load the MPI module, or set MPICC)"
  VENV=${VENV:-.venv-$STACK-site-mpi}
else
  SITE_MPICC=""
  VENV=${VENV:-.venv-$STACK}
fi
[ "$STACK" = rocm ] && _require_rocm7
PYTHON=${PYTHON:-python3}

_setup_stamp() {
  local sources="pyproject.toml"
  [ "$STACK" = rocm ] && sources="$sources launch/requirements-rocm.txt"
  printf 'stack=%s mpi=%s mpicc=%s checkout=%s\n' "$STACK" "$MPI_KIND" "$SITE_MPICC" "$PWD"
  cat $sources | sha256sum | cut -d' ' -f1
}

_setup_install() {
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  if [ "$MPI_KIND" = site ]; then
    # From source, against the site's libmpi; no wheel cache, which may hold a build
    # against another MPI.
    env MPICC="$SITE_MPICC" "${pip[@]}" --force-reinstall --no-deps --no-binary mpi4py \
        --no-cache-dir "mpi4py>=4" || return 1
  fi
  local mpich=""
  [ "$MPI_KIND" = pypi ] && mpich=",mpich"
  case "$STACK" in
    sim)    "${pip[@]}" -e ".[test$mpich]" || return 1 ;;
    cuda)   "${pip[@]}" -e ".[cuda,test$mpich]" || return 1 ;;
    cuda12) "${pip[@]}" -e ".[cuda12,test$mpich]" || return 1 ;;
    rocm)
      # numba-hip cannot share an environment with numba-cuda (pyproject.toml says why):
      # the AMD requirements first, then this package without its dependencies, then
      # the test extra's tools by name.
      "${pip[@]}" -r launch/requirements-rocm.txt "mpi4py>=4" ${mpich:+mpich} || return 1
      "${pip[@]}" --no-deps -e . || return 1
      local tools
      tools=$("$VENV/bin/python" -c 'import re
block = re.search(r"^test = \[(.*?)\]", open("pyproject.toml").read(), re.S | re.M).group(1)
print(" ".join(re.findall(r"\"([^\"]+)\"", block)))') || return 1
      "${pip[@]}" $tools || return 1 ;;  # unquoted: one word per requirement
  esac
}

_wanted=$(_setup_stamp)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.numba_cp-setup" 2>/dev/null)" != "$_wanted" ]; then
  if [ -e "$VENV" ] && ! grep -qsF "checkout=$PWD" "$VENV/.numba_cp-setup"; then
    rm -rf "$VENV"  # made elsewhere (or half made): its scripts point to another folder
  fi
  echo "setup: building $VENV (stack $STACK, MPI $MPI_KIND): it is missing or pyproject.toml changed" >&2
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || _setup_fail "$PYTHON -m venv $VENV failed"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip ||
      _setup_fail "could not upgrade pip in $VENV (is the package index reachable?)"
  fi
  _setup_install || _setup_fail "installing into $VENV failed (see above); nothing was recorded, so the next run tries again"
  printf '%s\n' "$_wanted" > "$VENV/.numba_cp-setup"
fi
unset _wanted
case "$VENV" in /*) export PATH="$VENV/bin:$PATH" ;; *) export PATH="$PWD/$VENV/bin:$PATH" ;; esac
