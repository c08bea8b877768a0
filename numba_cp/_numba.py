"""Every use of Numba's private attributes, in one place.

numba_cp leans on a few internals that no public API offers: the simulator's
shared-array bookkeeping and thread objects, the compiled specialisation and
parameter layout behind a numba-cuda kernel (for the direct ``cuLaunchKernel``
path), and the compile-only hooks of the ahead-of-time compile check. Each is
reached from here alone, so that a Numba upgrade breaks one module, and each
use says what happens when the attribute is gone.

Checked against:

- numba 0.68.1 with numba-cuda 0.30.4 (its CUDA target and its simulator);
- numba 0.63.1 with numba-hip 0.2.1 (the AMD target, compile-only).

``pyproject.toml`` pins numba-cuda to the tested minor release.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
import warnings
from types import SimpleNamespace

import numpy as np

TESTED = {"numba": ("0.63", "0.68"), "numba-cuda": ("0.30",), "numba-hip": ("0.2",)}

__all__ = ["TESTED", "lock_simulated_shared_arrays", "simulated_device_view",
           "simulated_warp_slot", "kernel_py_func", "compiled_function",
           "flattened_array_fields", "launch_with_cuda_core", "warn_fallback",
           "stand_in_device", "intrinsic_api", "llvm_module_in_context", "comgr_compile",
           "target_machine_handle", "enable_disk_cache", "stand_in_context",
           "compile_for_cache", "load_from_cache"]


# ---------------------------------------------------------------------------
# The simulator


def lock_simulated_shared_arrays():
    """Make the simulator's ``cuda.shared.array`` allocate under a lock.

    It keys a block's shared arrays by source line with an unlocked
    check-then-insert (``FakeCUDAShared._allocations``), so two threads
    reaching the line together can each get a private array: thread 0's
    writes then vanish for the others, and kernels read garbage now and then.
    Same logic as the simulator's, plus the lock.
    """
    from numba.cuda.simulator import kernelapi

    types, numpy_support = kernelapi.types, kernelapi.numpy_support  # the simulator's own
    original = kernelapi.FakeCUDAShared.array
    if getattr(original, "_numba_cp_locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[-1][0:2])
        with lock:
            allocated = self._allocations.get(caller)
            if allocated is None:
                allocated = self._allocations[caller] = np.empty(shape, dtype)
        return allocated

    array._numba_cp_locked = True
    kernelapi.FakeCUDAShared.array = array


def simulated_device_view(host: np.ndarray):
    """The simulator's device array over ``host`` itself: no copy, any strides.

    Handing the simulator a bare NumPy array makes it copy the array in and
    out around every launch, and it refuses non-contiguous views.
    """
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(host)


def simulated_warp_slot(lanes: int):
    """``(warp index, per-block dict)`` of the calling simulated GPU thread.

    The simulator runs each GPU thread as a Python thread with a ``thread_id``
    and a ``_manager`` (its block's BlockManager, which runs one block at a
    time); the dict lives on the manager, so it is per block.
    """
    thread = threading.current_thread()
    return thread.thread_id // lanes, thread._manager.__dict__


# ---------------------------------------------------------------------------
# numba-cuda's compiled kernels, for the direct launch (numba_cp.launcher)


def kernel_py_func(kernel):
    """The Python function a ``cuda.jit`` kernel (or the simulator's) was built from."""
    return kernel.py_func


def compiled_function(dispatcher, args):
    """``(function handle, cuda.core kernel)`` of the specialisation ``args`` launch.

    Reads ``dispatcher.overloads`` and the specialisation's ``_codelibrary``.
    Raises (any exception) when they are missing or the kernel is not plain.
    """
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    compiled = dispatcher.overloads[argtypes]
    if compiled.cooperative or compiled.debug or compiled.extensions:
        raise RuntimeError("not a plain kernel (cooperative, debug or with extensions)")
    cufunc = compiled._codelibrary.get_cufunc()
    return cufunc.handle, cufunc.kernel


def max_threads_per_block(dispatcher, args):
    """The most threads per block the compiled specialisation ``args`` launches with
    (its registers decide), or None where that cannot be read.

    Reads ``dispatcher.overloads`` and the kernel's ``max_threads_per_block``.
    """
    try:
        argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
        return int(dispatcher.overloads[argtypes].max_threads_per_block)
    except Exception:  # noqa: BLE001 - an internal moved: no limit to report
        return None


def flattened_array_fields(device_array):
    """Numba's flattened array parameter: meminfo, parent, size, itemsize, data, shape, strides.

    Every field is 8 bytes; the data pointer is field 4.
    """
    itemsize = device_array.dtype.itemsize
    return [0, 0, device_array.size, itemsize, device_array.device_ctypes_pointer.value or 0,
            *device_array.shape, *device_array.strides]


FLATTENED_DATA_FIELD = 4


def launch_with_cuda_core(stream, dims, kernel, values):
    """``cuda.core.launch`` with the parameter values of a flattened launch."""
    from cuda.core import LaunchConfig, launch
    from numba.cuda._compat import CUDA_CORE_GE_1_0

    options = dict(grid=dims[:3], block=dims[3:], shmem_size=0)
    options["is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"] = False
    launch(stream, LaunchConfig(**options), kernel, *[int(v) for v in values])


def enable_disk_cache(dispatcher, folder: str) -> bool:
    """Give a numba-cuda kernel Numba's on-disk cache in ``folder`` (``cache=True``'s
    cache, in a folder of our choosing). Returns whether the kernel caches.

    ``dispatcher.enable_caching()`` builds a ``CUDACache`` whose locator reads
    ``numba.cuda.core.config.CACHE_DIR`` when it is made; the setting is put back
    right after, so nothing else in the process changes. A closure whose captured
    values do not pickle is left uncached: its cache key could not be computed at
    launch.
    """
    from numba.cuda.core import config
    from numba.cuda.dispatcher import CUDACache
    from numba.cuda.serialize import dumps

    try:
        if isinstance(dispatcher._cache, CUDACache):
            return True
        closure = dispatcher.py_func.__closure__ or ()
        dumps(tuple(cell.cell_contents for cell in closure))
        saved = config.CACHE_DIR
        config.CACHE_DIR = folder
        try:
            dispatcher.enable_caching()
        finally:
            config.CACHE_DIR = saved
        return isinstance(dispatcher._cache, CUDACache)
    except Exception:  # an internal moved, or the closure does not pickle: compile as before
        return False


_WARNED = set()


def warn_fallback(exc: BaseException):
    """Say once why the direct launch is off (Numba's dispatch is used instead)."""
    what = f"{type(exc).__name__}: {exc}"
    if what in _WARNED:
        return
    _WARNED.add(what)
    versions = ", ".join(f"{name} {'/'.join(v)}.x" for name, v in TESTED.items())
    warnings.warn(f"numba_cp: the direct kernel launch is unavailable ({what}); falling back "
                  f"to Numba's dispatch, which costs ~40 us more per call. numba_cp was "
                  f"checked against {versions}.", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------
# Writing intrinsics, per target


def intrinsic_api(target_name: str):
    """``(intrinsic, cgutils)`` for writing LLVM intrinsics on ``target_name``.

    numba-cuda and numba-hip keep them in different modules; numba-hip's
    ``cgutils`` is Numba core's.
    """
    if target_name == "cuda":
        from numba.cuda import cgutils
        from numba.cuda.extending import intrinsic
    elif target_name == "hip":
        from numba.core import cgutils
        from numba.hip.extending import intrinsic
    else:
        raise ValueError(f"no intrinsics on target {target_name!r}")
    return intrinsic, cgutils


# ---------------------------------------------------------------------------
# The compile check (numba_cp.compile_check)


@contextlib.contextmanager
def stand_in_device(target_name: str, **attributes):
    """While inside, the dispatcher compiles as if the current device had ``attributes``.

    numba-cuda and numba-hip compile a kernel's device functions for the
    *current* device (``dispatcher.get_current_device``); with no GPU, supply
    the target's compute capability or AMD arch instead.
    """
    if target_name == "hip":
        from numba.hip import dispatcher
    else:
        from numba.cuda import dispatcher
    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(**attributes)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


@contextlib.contextmanager
def stand_in_context(compute_capability, runtime_version=(13, 0)):
    """While inside, numba-cuda compiles and keys its disk cache as if a GPU of
    ``compute_capability`` were current, with no driver (tools/kernel_cache_timing.py).

    A kernel is compiled for the current context's device (``devices.get_context``,
    read by the code library and by the cache key's ``magic_tuple``, with the runtime
    version); with no GPU both are supplied here.
    """
    from numba.cuda import codegen
    from numba.cuda.cudadrv import devices, runtime

    context = SimpleNamespace(device=SimpleNamespace(compute_capability=compute_capability))
    saved = devices.get_context, codegen.devices.get_context, runtime.runtime.get_version
    devices.get_context = codegen.devices.get_context = lambda *args, **kwargs: context
    runtime.runtime.get_version = lambda: runtime_version
    try:
        with stand_in_device("cuda", compute_capability=compute_capability):
            yield
    finally:
        devices.get_context, codegen.devices.get_context, runtime.runtime.get_version = saved


def compile_for_cache(dispatcher, signature, compute_capability):
    """Compile one specialisation as a launch would (NVVM, then nvJitLink to a cubin)
    and save it in the dispatcher's disk cache; returns the compiled kernel."""
    from numba.core import sigutils
    from numba.cuda.dispatcher import _Kernel

    argtypes, _ = sigutils.normalize_signature(signature)
    kernel = _Kernel(dispatcher.py_func, argtypes, **dispatcher.targetoptions)
    kernel._codelibrary.get_cubin(cc=compute_capability)
    dispatcher._cache.save_overload(signature, kernel)
    return kernel


def load_from_cache(dispatcher, signature):
    """The specialisation from the dispatcher's disk cache, or None."""
    from numba.cuda.descriptor import cuda_target

    return dispatcher._cache.load_overload(signature, cuda_target.target_context)


def llvm_module_in_context(context, llvm_ir: str):
    """numba-hip's parse of LLVM IR text into a module of ``context``."""
    from numba.hip.util import llvmutils

    (module,) = llvmutils._get_module_in_context(context, llvm_ir)
    return module


def comgr_compile(llvm_ir: str, arch: str):
    """numba-hip's own LLVM IR -> relocatable path through the system's comgr."""
    from numba.hip.util import comgrutils, llvmutils

    return comgrutils.compile_bc(llvmutils.to_bc(llvm_ir), isa_name=f"amdgcn-amd-amdhsa--{arch}",
                                 logging=True)


def target_machine_handle(machine):
    """The LLVMTargetMachineRef inside numba-hip's ``AMDGPUTargetMachine``."""
    return machine._target_machine
