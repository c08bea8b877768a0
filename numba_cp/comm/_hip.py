"""The HIP runtime calls CuPy does not wrap, through ctypes; the only such module.

The fused IPC exchange's buffers (flags and keys in one allocation) are
allocated uncached on AMD GPUs, as RCCL allocates its peer-to-peer FIFOs with
their flags, AITER its signal and scratch buffers, and vLLM's custom
all-reduce its shared buffers: ``hipExtMallocWithFlags(...,
hipDeviceMallocUncached)``. The driver maps such memory uncached on a peer
(MTYPE UC: a peer's stores over XGMI skip its L2) and cache-coherent on its
own GPU (MTYPE CC), on gfx90a and gfx942 alike, so a key or flag a peer
wrote is what the owner's next load reads. See docs/SPEC.md, section 10.2.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

__all__ = ["DEVICE_MALLOC_UNCACHED", "ALLOCATION_GRANULE", "malloc_uncached"]

# hip/hip_runtime_api.h
DEVICE_MALLOC_UNCACHED = 0x3  # hipDeviceMallocUncached
HIP_SUCCESS = 0
# An uncached allocation under 2 MiB exports an IPC handle only when its size is
# whole 4 KiB pages (as AITER notes for its uncached meta buffer).
ALLOCATION_GRANULE = 4096


@lru_cache(maxsize=None)
def _library():
    name = ctypes.util.find_library("amdhip64") or "libamdhip64.so"
    library = ctypes.CDLL(name)
    malloc = library.hipExtMallocWithFlags
    malloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
    malloc.restype = ctypes.c_int
    error = library.hipGetErrorString
    error.argtypes = (ctypes.c_int,)
    error.restype = ctypes.c_char_p
    return library


def malloc_uncached(nbytes: int) -> int:
    """Device memory of ``nbytes`` (rounded up to whole pages) that no GPU cache keeps;
    free it with ``hipFree`` (CuPy's ``runtime.free``)."""
    library = _library()
    size = -(-int(nbytes) // ALLOCATION_GRANULE) * ALLOCATION_GRANULE
    pointer = ctypes.c_void_p()
    status = library.hipExtMallocWithFlags(ctypes.byref(pointer), size, DEVICE_MALLOC_UNCACHED)
    if status != HIP_SUCCESS:
        raise RuntimeError(f"hipExtMallocWithFlags({size}, hipDeviceMallocUncached) failed: "
                           f"{library.hipGetErrorString(status).decode()} ({status})")
    return int(pointer.value or 0)
