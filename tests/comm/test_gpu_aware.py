"""Whether the MPI library reads GPU memory: the environment, Cray's switch, the ctypes queries.

The queries run against stand-in libraries handed to
``gpu_aware_mpi(name, library=(version string, handles))``: ctypes callbacks
in place of the symbols MPICH and Open MPI export. One test asks the library
mpi4py really loaded.
"""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from numba_cp.comm import GPU_AWARE_ENV, gpu_aware_mpi  # noqa: E402
from numba_cp.comm import gpu_aware as G  # noqa: E402

MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024"
OPEN_MPI = "Open MPI v5.0.3, package: Open MPI builder, ident: 5.0.3"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.30.8 (ANL base 3.4a2)"

_GPU_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_INT_QUERY = ctypes.CFUNCTYPE(ctypes.c_int)


def _lib(**symbols):
    """A stand-in for a loaded libmpi exposing ``symbols`` (and MPI_Init, as libmpi does)."""
    return types.SimpleNamespace(MPI_Init=object(), **symbols)


def _library(version, *libs):
    return version, lambda: [(lib, f"stand-in {i}") for i, lib in enumerate(libs)]


def _never_asked():
    pytest.fail("the library was asked although the answer did not depend on it")


@pytest.mark.parametrize("backend_name", ["cuda", "hip", "sim"])
def test_env_forces_the_answer(monkeypatch, backend_name):
    monkeypatch.setenv(GPU_AWARE_ENV, "1")
    aware, reason = gpu_aware_mpi(backend_name)
    assert aware is True and GPU_AWARE_ENV in reason
    monkeypatch.setenv(GPU_AWARE_ENV, "0")
    aware, reason = gpu_aware_mpi(backend_name)
    assert aware is False and GPU_AWARE_ENV in reason
    monkeypatch.setenv(GPU_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match=GPU_AWARE_ENV):
        gpu_aware_mpi(backend_name)


def test_env_beats_the_library(monkeypatch):
    monkeypatch.setenv(GPU_AWARE_ENV, "1")
    assert gpu_aware_mpi("cuda", library=(MPICH, _never_asked))[0] is True
    monkeypatch.setenv(GPU_AWARE_ENV, "0")
    assert gpu_aware_mpi("hip", library=(OPEN_MPI, _never_asked))[0] is False


def test_sim_and_bad_name():
    assert gpu_aware_mpi("sim") == (False, "the sim backend has no device memory for MPI to read")
    with pytest.raises(ValueError, match="backend_name"):
        gpu_aware_mpi("opencl")


def test_asks_the_loaded_library():
    """The real ctypes path on the MPI mpi4py loaded (MPICH's wheel here)."""
    if sys.platform.startswith("linux"):
        handles = G._libmpi_handles()
        assert handles, "no handle on the MPI library's symbols"
        assert all(G._symbol(lib, "MPI_Get_library_version") is not None for lib, _ in handles)
    cuda_answer, cuda_reason = gpu_aware_mpi("cuda")
    hip_answer, hip_reason = gpu_aware_mpi("hip")
    assert isinstance(cuda_answer, bool) and isinstance(hip_answer, bool)
    version = MPI.Get_library_version()
    if MPI.get_vendor()[0] == "MPICH" and "CRAY" not in version.upper() \
            and version.startswith("MPICH Version"):
        assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA=0)" in cuda_reason
        assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_HIP=2)" in hip_reason


def test_mpich_query():
    seen = []

    def query(gpu_type, is_supported):
        seen.append(gpu_type)
        is_supported[0] = 1 if gpu_type == G.MPIX_GPU_SUPPORT_CUDA else 0
        return 0

    callback = _GPU_QUERY(query)
    # MPIX_Query_cuda_support must not be consulted when MPIX_GPU_query_support exists
    lib = _lib(MPIX_GPU_query_support=callback, MPIX_Query_cuda_support=_INT_QUERY(lambda: 0))
    aware, reason = gpu_aware_mpi("cuda", library=_library(MPICH, lib))
    assert aware is True
    assert reason == ("MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA=0) gave 1 "
                      "(MPICH Version: 4.2.0, via stand-in 0)")
    assert gpu_aware_mpi("hip", library=_library(MPICH, lib))[0] is False
    assert seen == [0, 2]  # MPIX_GPU_SUPPORT_CUDA, MPIX_GPU_SUPPORT_HIP


def test_mpich_query_on_a_later_handle():
    """The first handle lacks the symbol (mpi4py's module, say); a later one has it."""
    def supported(gpu_type, is_supported):
        is_supported[0] = 1
        return 0

    lib = _lib(MPIX_GPU_query_support=_GPU_QUERY(supported))
    aware, reason = gpu_aware_mpi("cuda", library=_library(MPICH, _lib(), lib))
    assert aware is True and "via stand-in 1" in reason


def test_mpich_query_error():
    lib = _lib(MPIX_GPU_query_support=_GPU_QUERY(lambda gpu_type, out: 17))
    aware, reason = gpu_aware_mpi("cuda", library=_library(MPICH, lib))
    assert aware is False and "error 17" in reason


def test_open_mpi_queries():
    lib = _lib(MPIX_Query_cuda_support=_INT_QUERY(lambda: 1),
               MPIX_Query_rocm_support=_INT_QUERY(lambda: 0))
    aware, reason = gpu_aware_mpi("cuda", library=_library(OPEN_MPI, lib))
    assert aware is True and "MPIX_Query_cuda_support() gave 1" in reason
    aware, reason = gpu_aware_mpi("hip", library=_library(OPEN_MPI, lib))
    assert aware is False and "MPIX_Query_rocm_support() gave 0" in reason


def test_missing_symbols():
    aware, reason = gpu_aware_mpi("cuda", library=_library(OPEN_MPI, _lib()))
    assert aware is False and "no GPU-support query" in reason and GPU_AWARE_ENV in reason
    aware, reason = gpu_aware_mpi("hip", library=_library(OPEN_MPI))
    assert aware is False and "no handle" in reason


def test_cray_decides_by_its_env(monkeypatch):
    aware, reason = gpu_aware_mpi("cuda", library=(CRAY, _never_asked))
    assert aware is False and "MPICH_GPU_SUPPORT_ENABLED" in reason
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    assert gpu_aware_mpi("hip", library=(CRAY, _never_asked))[0] is True
