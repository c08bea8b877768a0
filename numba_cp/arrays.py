"""Turning caller arrays into kernel arguments for the active backend.

On a GPU backend anything exposing ``__cuda_array_interface__`` (CuPy, PyTorch
CUDA tensors, Numba device arrays) or DLPack is accepted as a zero-copy view;
host NumPy arrays are refused, since Numba would silently copy them to the
device and back. Under the simulator, host NumPy arrays are what kernels take.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _torch
from ._numba import simulated_device_view
from .backend import TARGET, cuda

__all__ = ["KernelArray", "as_kernel_array", "with_leading_axis", "device_view", "FixedView",
           "fixed_view", "c_contiguous", "data_address",
           "byte_range",
           "resolve_stream", "default_stream_for", "stream_handle", "synchronize", "device_copy",
           "host_copy"]


class KernelArray:
    """A kernel argument plus the metadata the host wrappers validate."""

    __slots__ = ("arg", "dtype", "shape", "strides", "name", "readonly")

    def __init__(self, arg, dtype, shape, strides, name, readonly=False):
        self.arg = arg
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(n) for n in shape)
        self.strides = strides
        self.name = name
        self.readonly = bool(readonly)

    def extent(self) -> tuple[int, int]:
        """``(low, high)`` byte offsets of the memory it touches, from its data pointer."""
        if any(n == 0 for n in self.shape):
            return 0, 0
        strides = self.strides or ()
        low = sum(min(0, (n - 1) * st) for n, st in zip(self.shape, strides))
        high = sum(max(0, (n - 1) * st) for n, st in zip(self.shape, strides))
        return low, high + self.dtype.itemsize

    @property
    def ndim(self):
        return len(self.shape)


class _InterfaceView:
    """A bare ``__cuda_array_interface__`` holder: how a raw address becomes an array."""

    def __init__(self, interface):
        self.__cuda_array_interface__ = interface


class FixedView:
    """A device array whose place never changes (a transport's buffer), described once.

    Its ``__cuda_array_interface__`` is a plain attribute and ``signature`` is
    what :func:`numba_cp.launcher.array_signature` would compute, so keying a
    launch on it is a lookup, not the dict Numba builds on every access.
    """

    def __init__(self, interface):
        self.__cuda_array_interface__ = interface
        strides = interface.get("strides")
        self.signature = ((interface["typestr"], tuple(interface["shape"]),
                           None if strides is None else tuple(strides),
                           bool(interface["data"][1])), interface["data"][0])


def fixed_view(array):
    """``array`` as a :class:`FixedView`; under the simulator, ``array`` itself."""
    if TARGET.simulator:
        return array
    return FixedView(dict(array.__cuda_array_interface__, stream=None))


def device_view(pointer: int, count, dtype, strides=None):
    """A Numba device array of ``count`` ``dtype`` at device address ``pointer`` (no owner);
    ``count`` may be a shape, with byte ``strides``."""
    shape = tuple(int(n) for n in count) if isinstance(count, tuple) else (int(count),)
    interface = {"shape": shape, "typestr": np.dtype(dtype).str,
                 "data": (int(pointer), False),
                 "strides": None if strides is None else tuple(int(n) for n in strides),
                 "stream": None, "version": 3}
    return cuda.as_cuda_array(_InterfaceView(interface), sync=False)


def _from_dlpack(obj, name):
    try:
        import cupy
    except ImportError:
        raise TypeError(f"{name}: DLPack arrays need CuPy installed to be viewed on the "
                        f"{TARGET.name} backend; pass an array with "
                        f"__cuda_array_interface__") from None
    try:
        return cupy.from_dlpack(obj)
    except Exception as exc:  # a DLPack capsule on the wrong device, say
        raise TypeError(f"{name}: cannot view this DLPack array on the {TARGET.name} device "
                        f"({exc})") from None


def as_kernel_array(obj, name: str) -> KernelArray:
    """Validate that ``obj`` lives where the backend's kernels can read it; wrap it."""
    if TARGET.simulator:
        if isinstance(obj, np.ndarray):
            return KernelArray(simulated_device_view(obj), obj.dtype, obj.shape, obj.strides,
                               name, readonly=not obj.flags.writeable)
        if getattr(obj, "__cuda_ndarray__", False):  # the simulator's own device array
            return KernelArray(obj, obj.dtype, obj.shape, obj.strides, name)
        if hasattr(obj, "__cuda_array_interface__"):
            raise TypeError(f"{name}: a device array was given but the active backend is the "
                            "CPU simulator, which takes host NumPy arrays")
        raise TypeError(f"{name}: expected a NumPy array, got {type(obj).__name__}")
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{name}: a host NumPy array was given but the {TARGET.name} backend takes "
                        "device arrays (CuPy, PyTorch CUDA, anything with "
                        "__cuda_array_interface__)")
    try:
        has_interface = hasattr(obj, "__cuda_array_interface__")
    except RuntimeError as exc:  # PyTorch's refusal of a tensor that requires grad
        raise TypeError(f"{name}: {exc}") from None
    if not has_interface:
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(f"{name}: expected a device array, got {type(obj).__name__}")
        obj = _from_dlpack(obj, name)
    readonly = bool(obj.__cuda_array_interface__["data"][1])
    device_array = cuda.as_cuda_array(obj, sync=False)
    return KernelArray(device_array, device_array.dtype, device_array.shape,
                       device_array.strides, name, readonly=readonly)


def with_leading_axis(array: KernelArray) -> KernelArray:
    """``array`` viewed as shape ``(1, *shape)`` without copying."""
    if TARGET.simulator:
        view = np.asarray(array.arg)[np.newaxis]
        return KernelArray(simulated_device_view(view), view.dtype, view.shape, view.strides,
                           array.name)
    interface = dict(array.arg.__cuda_array_interface__)
    strides = interface.get("strides") or _contiguous_strides(array.shape, array.dtype.itemsize)
    interface["shape"] = (1,) + tuple(interface["shape"])
    interface["strides"] = (0,) + tuple(strides)
    interface["stream"] = None
    view = cuda.as_cuda_array(_InterfaceView(interface), sync=False)
    return KernelArray(view, view.dtype, view.shape, view.strides, array.name)


def _contiguous_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def c_contiguous(array: KernelArray) -> bool:
    """Whether ``array``'s elements lie in C order with no gaps (an axis of extent 1
    may have any stride; an empty array is contiguous)."""
    if array.strides is None or 0 in array.shape:
        return True
    packed = _contiguous_strides(array.shape, array.dtype.itemsize)
    return all(n == 1 or stride == step
               for n, stride, step in zip(array.shape, array.strides, packed))


def data_address(array: KernelArray) -> int:
    """The address of ``array``'s first element (host memory under the simulator)."""
    if TARGET.simulator:
        return int(np.asarray(array.arg).__array_interface__["data"][0])
    return int(array.arg.device_ctypes_pointer.value or 0)


def byte_range(array, name: str) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous array: NumPy, the simulator's device
    arrays (host memory), Numba device arrays, or anything with
    ``__cuda_array_interface__``. Raises ValueError naming ``name`` otherwise."""
    simulated = TARGET.simulator and getattr(array, "__cuda_ndarray__", False)
    if isinstance(array, np.ndarray) or simulated:
        host = np.asarray(array)
        if not host.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")
        return host.__array_interface__["data"][0], host.nbytes
    if hasattr(array, "is_c_contiguous"):  # a Numba device array
        if not array.is_c_contiguous():
            raise ValueError(f"{name}: must be C-contiguous")
        return int(array.device_ctypes_pointer.value or 0), int(array.nbytes)
    view = as_kernel_array(array, name)
    return byte_range(view.arg, name)


_EXTERNAL_STREAMS: dict = {}


def resolve_stream(stream, like=None):
    """The stream kernels launch on: ``stream`` if given, else :func:`default_stream_for`
    ``like`` (a call's first array).

    Accepts a Numba stream, a CuPy stream, a PyTorch stream (anything with a
    ``ptr``/``cuda_stream`` handle) or a raw integer handle. The simulator has
    one stream, ``0``.
    """
    if TARGET.simulator:
        return 0
    if stream is None:
        stream = default_stream_for(like)
    # A raw handle (the eager default) skips the probes: each failed hasattr raises inside.
    if type(stream) is int:
        wrapped = _EXTERNAL_STREAMS.get(stream)
        if wrapped is not None:
            return wrapped
    else:
        kind = _STREAM_KINDS.get(type(stream))
        if kind is None:
            kind = _STREAM_KINDS[type(stream)] = _stream_kind(stream)
        if kind == "numba":
            return stream
        if kind:
            stream = getattr(stream, kind)
    if isinstance(stream, (int, np.integer)):
        handle = int(stream)
        wrapped = _EXTERNAL_STREAMS.get(handle)
        if wrapped is None:  # a wrapper is only a handle: make each once
            wrapped = cuda.external_stream(handle) if handle else cuda.default_stream()
            _EXTERNAL_STREAMS[handle] = wrapped
        return wrapped
    raise TypeError(f"stream: expected a Numba, CuPy or PyTorch stream or an int handle, "
                    f"got {type(stream).__name__}")


_STREAM_KINDS: dict = {}  # a stream's type -> what _stream_kind said of it


def _stream_kind(stream):
    """``"numba"`` for a Numba stream, else the attribute that holds the handle (``"ptr"``
    for CuPy, ``"cuda_stream"`` for PyTorch), else ``""``. Asked once per type: each
    failed probe raises inside."""
    if (hasattr(stream, "handle") and hasattr(stream, "synchronize")
            and not hasattr(stream, "ptr")):
        return "numba"
    for attribute in ("ptr", "cuda_stream"):
        if hasattr(stream, attribute):
            return attribute
    return ""


def default_stream_for(like=None):
    """Where a call whose first array is ``like`` launches when given no stream.

    A PyTorch tensor: PyTorch's current stream, where a PyTorch caller queues
    the work around the call (``torch.cuda.stream(...)`` contexts included).
    Anything else: CuPy's current stream, or Numba's default stream where
    CuPy was never imported. Returns what :func:`resolve_stream` accepts.
    """
    if like is not None:
        torch = _torch.found()
        if torch is not None and isinstance(like, torch.tensor):
            return torch.current_stream()
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return cuda.default_stream()
    return cupy.cuda.get_current_stream().ptr


def stream_handle(stream) -> int:
    """The raw CUDA/HIP handle of :func:`resolve_stream`'s stream (0 under the simulator)."""
    resolved = resolve_stream(stream)
    if TARGET.simulator:
        return 0
    handle = resolved.handle
    return int(getattr(handle, "value", handle) or 0)


def synchronize(stream):
    """Wait for a :func:`resolve_stream` stream (simulated kernels are done on return)."""
    if not TARGET.simulator:
        stream.synchronize()


def device_copy(host: np.ndarray, *, simulated_device: bool = False):
    """A copy of ``host`` where the active backend's kernels read it.

    CuPy on GPU backends (cupy-cuda13x / cupy-rocm-7-0), NumPy under the
    simulator, or with ``simulated_device`` the simulator's device array (what
    device transports take there).
    """
    if TARGET.simulator:
        return cuda.to_device(host) if simulated_device else np.array(host, copy=True)
    import cupy

    return cupy.asarray(host)


def host_copy(array) -> np.ndarray:
    """``array`` (from :func:`device_copy` or any device array) as a host NumPy array."""
    if isinstance(array, np.ndarray):
        return array.copy()
    if hasattr(array, "copy_to_host"):  # Numba device arrays, the simulator's too
        return array.copy_to_host()
    if hasattr(array, "get"):
        return array.get()
    return cuda.as_cuda_array(array).copy_to_host()
