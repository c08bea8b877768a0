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
loads it without a device, for ahead-of-time compile checks only. Every other module gets ``cuda`` from here
and asks :data:`NAME` instead of probing the machine again.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

__all__ = ["NAME", "cuda", "is_simulator", "describe", "BackendError"]

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
        return cuda
    if name == "hip":
        try:
            from numba import hip
        except Exception as exc:  # numba-hip parses HIP headers at import time
            raise BackendError(
                "ROCm toolchain not found: numba-hip needs ROCm's comgr, libclang and "
                f"hiprtc builtins to import ({type(exc).__name__}: {exc})") from None
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


NAME: str = _choose()
cuda = _load(NAME)
is_simulator: bool = NAME == "sim"


def describe() -> str:
    """One line naming the active target, for logs and the launch drivers."""
    if NAME == "sim":
        return "sim (Numba CUDA simulator on the CPU)"
    device = cuda.get_current_device()
    label = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    return f"{NAME} ({label})"
