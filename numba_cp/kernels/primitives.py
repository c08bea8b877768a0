"""The few device primitives whose spelling differs between targets.

Everything else in :mod:`numba_cp.kernels` is plain Numba that all three
targets accept. Keep this module tiny: one function per primitive, one
definition per target, and a simulator fallback written in plain Python (the
simulator runs kernels as Python threads, so a Python function is a device
function there).
"""

import numpy as np
from numba import int64

from ..backend import NAME, cuda

__all__ = ["float_bits", "shared_atomic_add"]

if NAME == "sim":

    def float_bits(x):
        """uint32 bit pattern of float32 ``x``, widened to int64."""
        return np.int64(np.float32(x).view(np.uint32))

elif NAME == "cuda":
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def float_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF

elif NAME == "hip":
    from numba import hip

    @cuda.jit(device=True, inline=True)
    def float_bits(x):
        return int64(hip.float_as_uint(x)) & 0xFFFFFFFF

else:  # pragma: no cover - backend.py admits only the names above
    raise ImportError(f"no primitives for backend {NAME!r}")


@cuda.jit(device=True, inline=True)
def shared_atomic_add(array, index, value):
    """``array[index] += value`` atomically; returns the old value."""
    return cuda.atomic.add(array, index, value)
