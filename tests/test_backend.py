"""Backend selection happens once, in numba_cp.backend, and fails with one clear sentence."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env_changes):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("NUMBA_CP_BACKEND", None)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_active_backend_is_reported():
    from numba_cp import backend

    assert backend.NAME in ("sim", "cuda", "hip")
    assert backend.describe().startswith(backend.NAME)
    assert backend.TARGET.name == backend.NAME
    assert backend.TARGET.simulator is backend.is_simulator is (backend.NAME == "sim")


def test_target_is_frozen_and_knows_its_warp_width():
    import dataclasses

    from numba_cp.backend import TARGET

    with pytest.raises(dataclasses.FrozenInstanceError):
        TARGET.lanes = 4
    if TARGET.simulator:  # as wide as NUMBA_CP_SIM_LANES says (8 by default)
        assert TARGET.lanes == int(os.environ.get("NUMBA_CP_SIM_LANES", "8"))
    else:  # an NVIDIA warp, a CDNA wavefront
        assert TARGET.lanes == {"cuda": 32, "hip": 64}[TARGET.name]
    assert dataclasses.replace(TARGET, name="sim").simulator
    assert not dataclasses.replace(TARGET, name="cuda").simulator


def test_unknown_backend_name_is_rejected():
    proc = run_python("import numba_cp", NUMBA_CP_BACKEND="opencl")
    assert proc.returncode != 0
    assert "NUMBA_CP_BACKEND='opencl': expected one of hip, cuda, sim" in proc.stderr


def test_forced_sim_backend_even_after_numba_was_imported():
    proc = run_python("import numba, numba_cp; print(numba_cp.backend.NAME)",
                      NUMBA_CP_BACKEND="sim")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "sim"


def test_conflict_with_an_earlier_numba_cuda_import_is_named():
    proc = run_python("import numba.cuda; import numba_cp", NUMBA_ENABLE_CUDASIM="1",
                      NUMBA_CP_BACKEND="cuda")
    assert proc.returncode != 0
    assert "numba.cuda was already imported as the sim target" in proc.stderr


@pytest.mark.skipif(os.path.exists("/dev/kfd"), reason="an AMD GPU node may have ROCm")
def test_hip_without_rocm_toolchain_fails_in_one_sentence():
    proc = run_python("import numba_cp", NUMBA_CP_BACKEND="hip")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("numba_cp.backend.BackendError: ROCm toolchain not found"), last


def test_cuda_without_gpu_fails_clearly():
    if run_python("import ctypes; ctypes.CDLL('libcuda.so.1')").returncode == 0:
        pytest.skip("an NVIDIA driver is present")
    proc = run_python("import numba_cp", NUMBA_CP_BACKEND="cuda")
    assert proc.returncode != 0
    assert "no usable NVIDIA GPU" in proc.stderr.strip().splitlines()[-1]
