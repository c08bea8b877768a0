"""Whether the loaded MPI library reads GPU memory (GPU-aware, CUDA- or ROCm-aware MPI).

mpi4py has no such query, so :func:`gpu_aware_mpi` asks the library through
ctypes: ``NUMBA_CP_GPU_AWARE_MPI=0|1`` forces the answer; Cray MPICH is
GPU-aware when ``MPICH_GPU_SUPPORT_ENABLED=1``; MPICH (4.0 and later) answers
``MPIX_GPU_query_support``; Open MPI answers ``MPIX_Query_cuda_support`` /
``MPIX_Query_rocm_support`` (its ``mpi-ext.h`` extensions).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

from ..backend import TARGET
from .base import mpi

__all__ = ["gpu_aware_mpi", "GPU_AWARE_ENV"]

GPU_AWARE_ENV = "NUMBA_CP_GPU_AWARE_MPI"

# mpi.h of MPICH >= 4.0 (src/include/mpi.h.in; the pip `mpich` wheel's
# include/mpi.h has the same): MPIX_GPU_SUPPORT_CUDA (0), _ZE (1), _HIP (2), for
# int MPIX_GPU_query_support(int gpu_type, int *is_supported).
MPIX_GPU_SUPPORT_CUDA = 0
MPIX_GPU_SUPPORT_ZE = 1
MPIX_GPU_SUPPORT_HIP = 2
_MPICH_GPU_TYPE = {"cuda": ("MPIX_GPU_SUPPORT_CUDA", MPIX_GPU_SUPPORT_CUDA),
                   "hip": ("MPIX_GPU_SUPPORT_HIP", MPIX_GPU_SUPPORT_HIP)}
# int f(void), returning 1 when supported: Open MPI's mpi-ext.h (cuda since 2.0,
# rocm since 5.0); MPICH >= 4.1 has MPIX_Query_cuda_support/_hip_support too;
# MVAPICH2 >= 2.3.4 has MPIX_Query_cuda_support.
_QUERY_FUNCTIONS = {"cuda": ("MPIX_Query_cuda_support",),
                    "hip": ("MPIX_Query_rocm_support", "MPIX_Query_hip_support")}


def _env_flag(var: str) -> bool | None:
    raw = os.environ.get(var, "").strip().lower()
    if not raw:
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{var}={raw!r}: expected 0 or 1")


def _symbol(lib, name):
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


def _libmpi_handles():
    """Handles through which the MPI library's symbols are visible, with a label each.

    mpi4py loads libmpi with RTLD_LOCAL, so ``ctypes.CDLL(None)`` usually sees
    none of it; a handle on mpi4py's own extension module (already loaded:
    RTLD_NOLOAD) does, since dlsym also searches that module's dependencies.
    """
    MPI = mpi()
    handles = []
    noload = getattr(os, "RTLD_NOLOAD", 0)
    module_path = getattr(MPI, "__file__", None)
    if module_path and noload:
        try:
            handles.append((ctypes.CDLL(module_path, mode=noload | ctypes.RTLD_LOCAL),
                            os.path.basename(module_path)))
        except OSError:
            pass
    try:
        handles.append((ctypes.CDLL(None), "the process's global symbols"))
    except (OSError, TypeError):  # CDLL(None) is POSIX only
        pass
    if noload:
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted(set(re.findall(r"(/\S*/libmpi[^/\s]*\.so[^/\s]*)", maps.read())))
        except OSError:
            paths = []
        for path in paths:
            try:
                handles.append((ctypes.CDLL(path, mode=noload | ctypes.RTLD_LOCAL), path))
            except OSError:
                pass
    return [(lib, label) for lib, label in handles if _symbol(lib, "MPI_Init") is not None]


@functools.lru_cache(maxsize=None)
def _probe_loaded_library(backend_name: str) -> tuple[bool, str]:
    return _probe(backend_name, mpi().Get_library_version(), _libmpi_handles)


def _probe(backend_name: str, version: str, handles) -> tuple[bool, str]:
    version = version.replace("\x00", "").strip()
    library = " ".join(version.splitlines()[0].split()) if version else "the MPI library"
    if "CRAY MPICH" in version.upper():
        raw = os.environ.get("MPICH_GPU_SUPPORT_ENABLED", "")
        if raw.strip() == "1":
            return True, f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1 ({library})"
        return False, (f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED={raw!r}; set it to 1 (and "
                       f"link the GTL library) for GPU-aware MPI ({library})")
    handles = handles()
    if not handles:
        return False, f"no handle on the MPI library's symbols was found ({library})"
    for lib, label in handles:
        query = _symbol(lib, "MPIX_GPU_query_support")
        if query is None:
            continue
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        query.restype = ctypes.c_int
        constant, gpu_type = _MPICH_GPU_TYPE[backend_name]
        supported = ctypes.c_int(0)
        err = query(gpu_type, ctypes.byref(supported))
        if err != 0:
            return False, f"MPIX_GPU_query_support({constant}) failed with error {err} ({library})"
        return bool(supported.value), (f"MPIX_GPU_query_support({constant}={gpu_type}) gave "
                                       f"{supported.value} ({library}, via {label})")
    for lib, label in handles:
        for name in _QUERY_FUNCTIONS[backend_name]:
            query = _symbol(lib, name)
            if query is None:
                continue
            query.argtypes = []
            query.restype = ctypes.c_int
            answer = query()
            return answer == 1, f"{name}() gave {answer} ({library}, via {label})"
    looked_for = ", ".join(("MPIX_GPU_query_support",) + _QUERY_FUNCTIONS[backend_name])
    return False, (f"{library} exposes no GPU-support query (looked for {looked_for}); "
                   f"set {GPU_AWARE_ENV}=1 if it is GPU-aware")


def gpu_aware_mpi(backend_name: str | None = None, *, library: tuple | None = None
                  ) -> tuple[bool, str]:
    """Whether the loaded MPI library reads device memory of ``backend_name``'s GPUs.

    Returns ``(answer, reason)``; ``backend_name`` defaults to the active backend
    (:data:`numba_cp.backend.TARGET`). ``NUMBA_CP_GPU_AWARE_MPI=0|1`` forces the
    answer. MPI must be initialized (importing ``mpi4py.MPI`` does that).

    ``library``: ``(version string, handles())`` to ask instead of the loaded
    library, where ``handles()`` returns ``[(ctypes library, label), ...]``
    through which its symbols are seen (tests hand in stand-ins). The loaded
    library's answer is cached.
    """
    backend_name = TARGET.name if backend_name is None else backend_name
    if backend_name not in ("cuda", "hip", "sim"):
        raise ValueError(f"backend_name: expected 'cuda', 'hip' or 'sim', got {backend_name!r}")
    forced = _env_flag(GPU_AWARE_ENV)
    if forced is not None:
        return forced, f"forced by {GPU_AWARE_ENV}={os.environ[GPU_AWARE_ENV].strip()}"
    if backend_name == "sim":
        return False, "the sim backend has no device memory for MPI to read"
    MPI = mpi()
    if library is None and (not MPI.Is_initialized() or MPI.Is_finalized()):
        return False, "MPI is not initialized, so the library cannot be asked"
    if library is not None:
        return _probe(backend_name, *library)
    return _probe_loaded_library(backend_name)
