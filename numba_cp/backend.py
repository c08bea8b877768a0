"""The one place that decides which Numba target runs the kernels.

Targets:

``hip``
    numba-hip on an AMD GPU. ``numba.hip.pose_as_cuda()`` makes every later
    ``from numba import cuda`` resolve to HIP, so it must run before anything
    imports ``numba.cuda``; it cannot be undone.
``cuda``
    numba-cuda on an NVIDIA GPU.
``sim``
    Numba's CUDA simulator on the CPU (host NumPy arrays in and out).

``NUMBA_CP_BACKEND=hip|cuda|sim`` forces a target; otherwise the first of
hip (ROCm device node and numba-hip present), cuda (an NVIDIA driver with at
least one device) and sim wins. ``NUMBA_CP_COMPILE_ONLY=1`` with a GPU target
loads it without a device, for ahead-of-time compile checks only.

Every other module gets ``cuda`` from here and asks :data:`TARGET` for what
differs between targets (warp width, default launch sizes) instead of probing
the machine or branching on the name again.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass, field

from ._numba import lock_simulated_shared_arrays

__all__ = ["TARGET", "Target", "NAME", "cuda", "is_simulator", "describe", "BackendError",
           "COMPILE_ONLY"]

CHOICES = ("hip", "cuda", "sim")
ENV_VAR = "NUMBA_CP_BACKEND"
# Ahead-of-time compile checks build GPU code on machines with no GPU.
COMPILE_ONLY = os.environ.get("NUMBA_CP_COMPILE_ONLY", "0") not in ("", "0")


class BackendError(RuntimeError):
    """The requested target cannot be used on this machine."""


def _nvidia_device_count() -> int:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _amd_gpu_present() -> bool:
    return os.path.exists("/dev/kfd") and importlib.util.find_spec("numba.hip") is not None


def _numba_cuda_already_imported() -> str | None:
    """The target an earlier ``import numba.cuda`` fixed, or None if none happened."""
    module = sys.modules.get("numba.cuda")
    if module is None:
        return None
    if getattr(module, "_numba_cp_hip", False) or "numba.hip" in sys.modules:
        return "hip"
    from numba.core import config

    return "sim" if config.ENABLE_CUDASIM else "cuda"


def _choose() -> str:
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested and requested not in CHOICES:
        raise BackendError(f"{ENV_VAR}={requested!r}: expected one of {', '.join(CHOICES)}")
    fixed = _numba_cuda_already_imported()
    if fixed is not None:
        if requested and requested != fixed:
            raise BackendError(
                f"{ENV_VAR}={requested} but numba.cuda was already imported as the {fixed} "
                f"target; import numba_cp before numba.cuda (or set {ENV_VAR}={fixed})")
        return fixed
    if requested:
        return requested
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "sim"
    if _amd_gpu_present():
        return "hip"
    if _nvidia_device_count() > 0:
        return "cuda"
    return "sim"


def _load(name: str):
    if name == "sim":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        from numba.core import config

        config.reload_config()  # numba read its environment at `import numba`
        # The simulator's scheduler busy-polls its Python threads under the GIL;
        # a short switch interval makes simulated blocks 5-7x faster.
        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-5))
        from numba import cuda

        lock_simulated_shared_arrays()
        return cuda
    if name == "hip":
        try:
            from numba import hip
        except Exception as exc:  # numba-hip loads ROCm's compiler libraries at import time
            raise BackendError(_hip_import_failure(exc)) from None
        hip.pose_as_cuda()
        from numba import cuda
        cuda._numba_cp_hip = True
        return cuda
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    try:
        from numba import cuda
    except ImportError as exc:
        raise BackendError(f"numba-cuda is not installed: {exc}") from None
    if not COMPILE_ONLY and not cuda.is_available():
        raise BackendError("NUMBA_CP_BACKEND=cuda but no usable NVIDIA GPU/driver was found")
    return cuda


# Why `from numba import hip` failed, keyed by a fragment of the error it raises.
_LOAD = "numba-hip could not load "
_HIP_FAILURES = (
    ("cannot import name 'hip'", "numba-hip is not installed (pip install numba-hip; it pins "
                                 "numba<0.64, so give it an environment of its own)"),
    ("No module named 'numba.hip'", "numba-hip is not installed (pip install numba-hip)"),
    ("rocm_sysdeps", _LOAD + "the zlib/zstd of TheRock's ROCm (librocm_sysdeps_z.so.1 and "
                     "librocm_sysdeps_zstd.so.1, looked up in /opt/rocm/lib/rocm_sysdeps/lib "
                     "and $LD_LIBRARY_PATH) that its bundled libLLVM links to"),
    ("amd_comgr", _LOAD + "ROCm's code object manager (libamd_comgr.so in $ROCM_PATH/lib)"),
    ("libclang", _LOAD + "ROCm's libclang ($ROCM_PATH/llvm/lib/libclang.so*)"),
    ("clang resource directory", _LOAD + "clang's resource headers "
                                 "($ROCM_PATH/llvm/lib/clang/<version>/include)"),
    ("hiprtc-builtins", _LOAD + "ROCm's hipRTC builtins (libhiprtc-builtins.so in $ROCM_PATH/lib)"),
    ("no ROCm installation found", _LOAD + "a ROCm installation ($ROCM_PATH, $ROCM_HOME or "
                                   "/opt/rocm)"),
    ("GLIBC_", _LOAD + "ROCm's libraries, which need a newer glibc than this system's"),
)


def _hip_import_failure(exc: BaseException) -> str:
    """One sentence naming what `from numba import hip` was missing."""
    text = " ".join(str(exc).split())
    cause = f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
    reason = next((why for fragment, why in _HIP_FAILURES if fragment in text),
                  _LOAD + "ROCm's compiler libraries (comgr, libclang, hipRTC builtins)")
    return f"ROCm toolchain not found: {reason} ({cause})"


def _simulated_lanes() -> int:
    """Lanes per simulated warp: NUMBA_CP_SIM_LANES (a power of two, 2 to 64), default 8.

    32 and 64 run CUDA's and CDNA's warp layouts on the CPU; 8 keeps the tests quick
    while every cross-lane stage of the warp kernels still runs.
    """
    text = os.environ.get("NUMBA_CP_SIM_LANES", "8")
    try:
        lanes = int(text)
    except ValueError:
        lanes = 0
    if not (2 <= lanes <= 64 and lanes & (lanes - 1) == 0):
        raise ValueError(f"NUMBA_CP_SIM_LANES must be a power of two from 2 to 64, got {text!r}")
    return lanes


@dataclass(frozen=True)
class Target:
    """What differs between the targets, for every module to ask.

    The simulator runs each GPU thread as a Python thread, so its launch sizes
    are small: they keep the tests quick while still running every code path
    (chunked rows, the cross-warp tree, the radix passes).
    """

    name: str  # "hip", "cuda" or "sim"
    lanes: int  # threads of a warp (an AMD wavefront)
    threads: int  # threads per block of the radix kernels
    row_warps: int  # the most warps the warp kernels give one row
    sort_tile: int  # the least keys a radix row sorts (see ops.default_sort_limit)
    ipc_threads: int  # threads per block of the IPC kernels
    ipc_push_blocks: int  # blocks per peer of the IPC push
    ipc_copy_blocks: int  # small: a spinning grid must not fill the GPU
    # A field, not a property: every eager call asks it several times.
    simulator: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "simulator", self.name == "sim")


def _target(name: str) -> Target:
    if name == "sim":
        return Target(name, _simulated_lanes(), threads=8, row_warps=2, sort_tile=64,
                      ipc_threads=8, ipc_push_blocks=2, ipc_copy_blocks=2)
    # 8 warps per row beat 16 and 32 in the H200 launch sweep (BENCHMARKS.md).
    return Target(name, 64 if name == "hip" else 32, threads=128, row_warps=8, sort_tile=64,
                  ipc_threads=256, ipc_push_blocks=8, ipc_copy_blocks=16)


NAME: str = _choose()
cuda = _load(NAME)
TARGET: Target = _target(NAME)
is_simulator: bool = TARGET.simulator


def describe() -> str:
    """One line naming the active target, for logs and the launch drivers."""
    if NAME == "sim":
        return "sim (Numba CUDA simulator on the CPU)"
    device = cuda.get_current_device()
    label = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    return f"{NAME} ({label})"
