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
import sys
from functools import lru_cache

__all__ = ["Driver", "driver"]

_LIBRARIES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


class Driver:
    """``libcuda``'s ``cuLaunchKernel`` and ``cuCtxGetCurrent`` with declared types."""

    def __init__(self, library):
        launch = library.cuLaunchKernel
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
            return Driver(ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    return None
