"""launch/setup_env.sh, which both README commands source: it builds the environment
once, and afterwards installs nothing (so a rerun needs no network) until what it was
built from changes.

A stand-in python records what setup asks of it instead of creating a venv or
calling pip, so these tests need no network either.
"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
# python3 for setup_env.sh: '-m venv DIR' makes DIR/bin/python (this script); pip is logged
echo "MPICC=${MPICC:-} $*" >> "$SETUP_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi
case "${SETUP_PIP_FAILS:-}:$*" in 1:*--upgrade*) ;; 1:*" pip install "*) exit 1 ;; esac
exit 0
"""


@pytest.fixture
def setup(tmp_path):
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    log = tmp_path / "setup.log"

    def source(**env):
        environment = {k: v for k, v in os.environ.items()
                       if not k.startswith(("NUMBA_CP_", "VENV", "MPICC"))}
        environment.update(PYTHON=str(python), VENV=str(tmp_path / "venv"),
                           SETUP_LOG=str(log), NUMBA_CP_STACK="sim")
        environment.update(env)
        proc = subprocess.run(["bash", "-c", "set -euo pipefail; source launch/setup_env.sh; "
                               "echo \"VENV=$VENV STACK=$STACK MPI=$MPI_KIND\"; "
                               "echo \"PATH=$PATH\""],
                              cwd=ROOT, env=environment, capture_output=True, text=True,
                              timeout=60)
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return proc, calls

    return source, tmp_path


def test_builds_once_then_installs_nothing(setup):
    source, tmp = setup
    proc, calls = source()
    assert proc.returncode == 0, proc.stderr
    assert "setup: building" in proc.stderr
    assert any(call.endswith(f"-m venv {tmp / 'venv'}") for call in calls), calls
    assert any("pip install" in call and "-e .[test,mpich]" in call for call in calls), calls
    assert f"PATH={tmp / 'venv' / 'bin'}:" in proc.stdout
    proc, calls = source()  # the rerun: no venv, no pip, no network
    assert proc.returncode == 0 and calls == [] and proc.stderr == "", (proc.stderr, calls)
    assert "STACK=sim MPI=pypi" in proc.stdout


def test_a_changed_recipe_reinstalls_into_the_same_environment(setup):
    source, tmp = setup
    source()
    stamp = tmp / "venv" / ".numba_cp-setup"
    stamp.write_text(stamp.read_text().replace("stack=sim", "stack=sim "))  # as if edited
    proc, calls = source()
    assert proc.returncode == 0, proc.stderr
    assert not any("-m venv" in call for call in calls), calls
    assert any("-e .[test,mpich]" in call for call in calls), calls


def test_a_failed_install_is_not_recorded(setup):
    source, tmp = setup
    proc, _ = source(SETUP_PIP_FAILS="1")
    assert proc.returncode == 2 and "installing into" in proc.stderr, proc.stderr
    assert not (tmp / "venv" / ".numba_cp-setup").exists()
    proc, calls = source()  # tried again, and recorded this time
    assert proc.returncode == 0 and any("-e .[test,mpich]" in call for call in calls)


def test_site_mpi_builds_mpi4py_with_the_sites_mpicc(setup):
    source, tmp = setup
    mpicc = tmp / "site" / "bin" / "mpicc"
    mpicc.parent.mkdir(parents=True)
    mpicc.write_text("#!/bin/sh\n")
    mpicc.chmod(0o755)
    proc, calls = source(NUMBA_CP_MPI="site", MPICC=str(mpicc))
    assert proc.returncode == 0, proc.stderr
    built = [call for call in calls if "--no-binary mpi4py" in call]
    assert built and built[0].startswith(f"MPICC={mpicc} "), calls
    assert any(call.endswith("-e .[test]") for call in calls), "no MPICH wheel with site MPI"


def test_site_mpi_without_mpicc_says_so(setup):
    source, tmp = setup
    proc, calls = source(NUMBA_CP_MPI="site", PATH="/usr/bin:/bin")
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert proc.stderr.startswith("setup: NUMBA_CP_MPI=site builds mpi4py with the site MPI's "
                                  "mpicc"), proc.stderr


def test_amd_stack_needs_rocm_7(setup):
    source, tmp = setup
    proc, calls = source(NUMBA_CP_STACK="rocm", ROCM_PATH=str(tmp / "no-rocm"))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "needs the ROCm 7 runtime (libamdhip64.so.7)" in proc.stderr


def test_unknown_stack_is_refused(setup):
    source, _ = setup
    proc, calls = source(NUMBA_CP_STACK="tpu")
    assert proc.returncode == 2 and "NUMBA_CP_STACK=tpu" in proc.stderr and calls == []
