"""The CUDA driver calls of an eager launch, straight from ``libcuda`` through ctypes.

An eager call makes two driver calls: ``cuCtxGetCurrent`` (the launch cache is
keyed on the context) and ``cuLaunchKernel``. cuda-bindings' Python wrappers
check and convert every argument into its own handle types on each call; here
the argument types are declared once and the handles are plain integers.
Nothing else in the package calls the driver this way.

Where ``libcuda`` cannot be loaded (no NVIDIA driver, or a platform whose
library has another name) :func:`driver` is None and callers use
cuda-bindings.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

__all__ = ["Driver", "driver", "per_thread_default_stream"]

_LIBRARIES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


def per_thread_default_stream() -> bool:
    """Whether stream 0 means the per-thread default stream, as cuda-bindings (and so
    Numba's own launches) read it: ``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM``."""
    return bool(int(os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") or 0))


class Driver:
    """``libcuda``'s ``cuLaunchKernel`` and ``cuCtxGetCurrent`` with declared types."""

    def __init__(self, library, per_thread=False):
        # The _ptsz entry point reads stream 0 as the calling thread's default stream.
        launch = library.cuLaunchKernel_ptsz if per_thread else library.cuLaunchKernel
        launch.restype = ctypes.c_int
        # f, grid x/y/z, block x/y/z, shared bytes, stream, kernelParams, extra
        launch.argtypes = ([ctypes.c_void_p] + [ctypes.c_uint] * 7
                           + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p])
        self.launch_kernel = launch
        current = library.cuCtxGetCurrent
        current.restype = ctypes.c_int
        current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._current = current

    def current_context(self) -> int:
        """The calling thread's current context handle (0: none)."""
        context = ctypes.c_void_p()  # one per call: threads may ask at once
        status = self._current(ctypes.byref(context))
        if status:
            raise RuntimeError(f"cuCtxGetCurrent failed: CUresult {status}")
        return context.value or 0


@lru_cache(maxsize=None)
def driver() -> Driver | None:
    """The loaded driver, or None where ``libcuda`` or either entry point is missing."""
    for name in _LIBRARIES:
        try:
            return Driver(ctypes.CDLL(name), per_thread_default_stream())
        except (OSError, AttributeError, ValueError):
            continue
    return None
