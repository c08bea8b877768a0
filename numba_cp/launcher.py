"""Validated kernel launches, cached per argument signature.

A host wrapper validates its arguments once per *signature* (every array's
dtype, shape and strides plus every scalar argument) and builds a
:class:`KernelLaunch`. A call with the same signature reuses it: only the
arrays' data pointers are read. Nothing a cached launch skips could differ
between two calls with one signature, so validation is not given up.

A launch reads the kernel's parameter declaration
(:mod:`numba_cp.kernels.params`): the wrapper hands its arrays in the kernel's
order, and the scalars, fixed per signature, follow.

On numba-cuda the cached launch also bypasses Numba's per-call dispatch
(argument typing and marshalling): the parameter block of the compiled
specialisation is built once, with a slot for each array's pointer, and handed
to ``cuLaunchKernel`` (``cuda.core.launch`` if the binding refuses it). A
kernel declared ``chained`` goes to ``cuLaunchKernelEx`` as a programmatic
dependent launch instead, where :func:`chained_launches` allows it. That
path reads a few numba-cuda internals (:mod:`numba_cp._numba`); if any is
missing it warns once and falls back, for that launch, to the portable path
that every target uses: Numba's own dispatch. :attr:`KernelLaunch.direct`
says which path a launch takes.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np

from . import _numba, _torch, kernel_cache, validate
from .arrays import (FixedView, as_kernel_array, c_contiguous, data_address, resolve_stream,
                     with_leading_axis)
from .backend import TARGET, cuda
from .kernels.params import Address, Array

__all__ = ["array_signature", "call_signature", "context_token", "KernelLaunch", "LaunchCache",
           "block_limit_error", "chained_launches", "set_chained_launches",
           "chained_launch_config"]

_MAX_CACHED = 4096


def array_signature(obj):
    """``((typestr, shape, strides, read-only), data pointer)`` of an array without viewing it.

    None means "not cacheable" (the wrapper then validates on every call). The
    pointer saves reading the interface twice.
    """
    return _signers()[0](obj)


_SIGNERS = (None, None, None)  # (TARGET, _torch.found(), the signers made for them)


def _signers():
    """``(sign one array, sign a call's arrays)`` for the current target and PyTorch
    (which the caller may import at any time): the per-array type tests with what they
    compare against looked up once, not once per array of every call."""
    global _SIGNERS
    torch = _torch.found()
    target, found, signers = _SIGNERS
    if target is not TARGET or found is not torch:
        signers = _make_signers(TARGET.simulator, torch, _cupy_ndarray())
        _SIGNERS = (TARGET, torch, signers)
    return signers


def _make_signers(simulator, torch, cupy_ndarray):
    if simulator:  # the simulator keys NumPy arrays only: the rest is validated per call
        torch = cupy_ndarray = None
        other_signature = _numpy_signature
    else:
        other_signature = _interface_signature
    tensor = torch.tensor if torch is not None else None
    tensor_typestrs = torch.typestrs if torch is not None else None
    strided = torch.strided if torch is not None else None
    # dtype -> dtype.str, which NumPy builds anew on every access: a third of a CuPy
    # array's key (155 of 455 ns on a 2-core CPU; 283 ns with this table)
    typestrs = {}

    def sign_call(arrays):
        # One loop over a call's arrays, with a CuPy array's and a tensor's keys written
        # out, not called: an eager call keys up to six arrays, and a function call per
        # array costs about as much as a CuPy array's key.
        keys, pointers = [], []
        for obj in arrays:
            kind = type(obj)
            if kind is cupy_ndarray:
                # CuPy builds its interface dict on every access (about 2 us); its
                # attributes say the same for the key. dtype.str is the interface's typestr.
                dtype = obj.dtype
                typestr = typestrs.get(dtype)
                if typestr is None:
                    typestr = typestrs[dtype] = dtype.str
                keys.append((typestr, obj.shape, obj.strides, False))
                pointers.append(obj.data.ptr)
                continue
            if obj is None:
                keys.append(None)
                pointers.append(None)
                continue
            if kind is tensor:
                # PyTorch builds its interface in Python on every access (several us);
                # the tensor's attributes give the same key: the interface omits a
                # contiguous tensor's strides, gives pointer 0 for an empty one and is
                # never read-only. Each of the seven reads (eight for a strided view)
                # costs 40-90 ns. A tensor the interface would refuse (or whose dtype
                # is not in the table) goes to the interface, and validation reports
                # its answer.
                try:
                    dtype = tensor_typestrs.get(obj.dtype)
                    if (dtype is not None and obj.is_cuda and not obj.requires_grad
                            and obj.layout is strided):
                        shape = obj.shape  # a torch.Size: a tuple, equal and hashed as one
                        pointer = 0 if 0 in shape else obj.data_ptr()
                        if obj.is_contiguous():
                            strides = None
                        else:
                            itemsize = dtype[1]
                            strides = tuple([step * itemsize for step in obj.stride()])
                        keys.append((dtype[0], shape, strides, False))
                        pointers.append(pointer)
                        continue
                except RuntimeError:  # a nested tensor has no shape to read
                    pass
            signed = obj.signature if kind is FixedView else other_signature(obj)
            if signed is None:
                return None, None
            keys.append(signed[0])
            pointers.append(signed[1])
        return tuple(keys), pointers

    def signature(obj):
        if obj is None:
            return None
        keys, pointers = sign_call((obj,))
        return None if keys is None else (keys[0], pointers[0])

    return signature, sign_call


def _numpy_signature(obj):
    if isinstance(obj, np.ndarray):
        return ((obj.dtype.str, obj.shape, obj.strides, not obj.flags.writeable),
                obj.__array_interface__["data"][0])
    return None


def _interface_signature(obj):
    try:
        interface = getattr(obj, "__cuda_array_interface__", None)
    except RuntimeError:  # PyTorch's refusal of a tensor that requires grad
        return None  # validation names the argument
    if interface is None:
        return None
    strides = interface.get("strides")
    pointer, readonly = interface["data"]
    return ((interface["typestr"], tuple(interface["shape"]),
             None if strides is None else tuple(strides), bool(readonly)), pointer)


@lru_cache(maxsize=None)
def _cupy_ndarray():
    """``cupy.ndarray``, or None where CuPy is not installed (looked up once)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy.ndarray


def context_token():
    """Identifies the current GPU context: compiled kernels belong to one context."""
    if TARGET.name != "cuda":
        return 0
    return _current_context()()


@lru_cache(maxsize=None)
def _current_context():
    """``() -> int``, the current context's handle, read once per call of every wrapper.

    Both candidates read ``cuCtxGetCurrent``. cuda-bindings returns a status and a
    context object in a tuple: 0.14-0.52 us per call on H100 hosts. CuPy's Cython
    binding returns the handle as an integer: 0.10 us where cuda-bindings took 0.14.
    CuPy's is taken where it is installed and answers as cuda-bindings does. A CuPy
    built for another CUDA may fail to load its driver functions, and then it would
    fail every call.
    """
    driver = _driver()

    def current_context():
        _, context = driver.cuCtxGetCurrent()
        return int(context)

    try:
        from cupy_backends.cuda.api.driver import ctxGetCurrent

        if ctxGetCurrent() == current_context():
            return ctxGetCurrent
    except Exception:  # not installed, or unusable here: cuda-bindings answers
        pass
    return current_context


CHAINED_ENV = "NUMBA_CP_CHAINED_LAUNCH"
_CHAINING = [None]  # set_chained_launches' choice; None: chained_launches() decides


def chained_launches() -> bool:
    """Whether launches of chained kernels may start before the kernel ahead of them
    on the stream has finished (CUDA's programmatic dependent launch).

    By default: on numba-cuda with a GPU of compute capability 9.0 or newer,
    unless ``NUMBA_CP_CHAINED_LAUNCH=0``. Each chained kernel first waits for the
    grid before it (``chain_grids`` in kernels/primitives.py), so only its
    launch overlaps the end of that grid, never a memory access.
    """
    chosen = _CHAINING[0]
    if chosen is None:
        setting = validate.env_switch(CHAINED_ENV, "ordinary launches",
                                      "chained where the GPU can")
        chosen = _CHAINING[0] = (TARGET.name == "cuda" and setting is not False and
                                 cuda.get_current_device().compute_capability >= (9, 0))
    return chosen


def set_chained_launches(enabled):
    """Turn chained launches on or off for later calls (``None``: the default of
    :func:`chained_launches`); returns the previous setting. On GPUs that cannot
    chain, on AMD GPUs and in the simulator launches stay ordinary."""
    previous = chained_launches()
    _CHAINING[0] = None
    if enabled is not None:
        _CHAINING[0] = bool(enabled) and chained_launches()
    return previous


def _chaining_refused(status):
    """The driver refused a chained launch that it took the ordinary way: launch every
    later one the ordinary way, and say so once."""
    _CHAINING[0] = False
    warnings.warn(f"numba_cp: the driver refused a chained kernel launch ({status!r}); "
                  f"launching the ordinary way from now on (set {CHAINED_ENV}=0 to skip "
                  f"the attempt)", RuntimeWarning, stacklevel=4)


@lru_cache(maxsize=None)
def _driver():
    """``cuda.bindings.driver``, imported once (an import statement per call costs)."""
    from cuda.bindings import driver

    return driver


def call_signature(arrays, scalars):
    """``(cache key, data pointers)`` of a call; ``(None, None)`` when an argument
    cannot be keyed (then: no cache).

    Scalars are keyed with their types: 2.0 == 2 and True == 1, yet they
    validate differently. The CUDA context is in the key, since a compiled
    kernel belongs to one context. A key holding an unhashable scalar fails
    to hash where it is looked up.
    """
    keys, pointers = _signers()[1](arrays)
    if keys is None:
        return None, None
    scalars = tuple(scalars)
    return (keys, scalars, tuple(map(type, scalars)), context_token()), pointers


class LaunchCache(dict):
    """signature -> KernelLaunch, bounded (a long-lived process sees few shapes).

    The last entry found is kept beside the table: an eager loop repeats one
    signature, and comparing its key with that entry's costs half of hashing it
    (the key is rebuilt, and so rehashed, on every call).
    """

    _last = (None, None)  # (key, launch) of the last call that found or made one

    def launch_for(self, arrays, scalars, plan):
        """The validated launch for this call (``plan(arrays, *scalars)`` builds a new
        one, validating), and the arrays' data pointers."""
        key, pointers = call_signature(arrays, scalars)
        last_key, launch = self._last
        if key is None or key != last_key:
            try:
                launch = self.get(key) if key is not None else None
            except TypeError:  # an unhashable scalar: no cache, and validation names it
                key = launch = None
            if launch is None:
                launch = plan(arrays, *scalars)
                if key is not None:
                    if len(self) >= _MAX_CACHED:
                        self.clear()
                    self[key] = launch
            if key is not None:
                self._last = (key, launch)
        footprint = getattr(launch, "footprint", None)
        if footprint is not None:
            footprint.check(arrays, pointers)
        return launch, pointers

    def clear(self):
        self._last = (None, None)
        super().clear()


class KernelLaunch:
    """One validated launch: kernel, grid, block and scalars; arrays supplied per call.

    Per call, ``objects`` are the wrapper's arrays in the kernel's declared
    order (the first ones: a kernel may take fewer than the wrapper has); an
    array with one dimension fewer than declared (the one-head 2-D table
    layout) is viewed as ``[1, ...]``. ``scalars`` are the kernel's scalar
    parameters in declared order.
    """

    def __init__(self, kernel, grid, block, scalars, footprint=None):
        self.kernel = kernel
        self.footprint = footprint  # checks per call that outputs overlap nothing
        self.grid = grid
        self.block = block
        self.params = _numba.kernel_py_func(kernel).params
        self.arrays = [p for p in self.params if isinstance(p, Array)]
        self.scalars = list(scalars)
        if len(self.scalars) != len(self.params) - len(self.arrays):
            raise TypeError(f"{len(self.scalars)} scalars for the parameters {self.params}")
        self._direct = None  # the numba-cuda fast path, built after the first launch
        self._direct_failed = TARGET.name != "cuda"
        if TARGET.name == "cuda":  # load what an earlier process compiled, keep what this one does
            kernel_cache.use_disk_cache(kernel)

    @property
    def direct(self) -> bool:
        """Whether calls go straight to ``cuLaunchKernel`` (numba-cuda, after the first)."""
        return self._direct is not None

    def _kernel_args(self, objects):
        views = {}
        for obj, param in zip(objects, self.arrays):
            view = as_kernel_array(obj, param.name)
            views[param.name] = view if view.ndim == param.ndim else with_leading_axis(view)
        scalars = iter(self.scalars)
        return [_array_arg(p, views[p.name]) if isinstance(p, Array) else next(scalars)
                for p in self.params]

    def __call__(self, objects, stream=None, pointers=None):
        """Launch on ``objects``; ``pointers`` (from :func:`array_signature`) may be given.

        With no ``stream``, the first array picks it
        (:func:`numba_cp.arrays.default_stream_for`).
        """
        if self._direct is not None:
            return self._direct(objects, stream, pointers)
        args = self._kernel_args(objects)
        if TARGET.simulator:
            self.kernel[self.grid, self.block](*args)
            return None
        stream = resolve_stream(stream, objects[0])
        try:
            self.kernel[self.grid, self.block, stream](*args)
        except Exception as exc:
            self._name_block_limit(args, exc)
            raise
        if not self._direct_failed:
            try:
                self._direct = _DirectLaunch(self, args)
            except Exception as exc:  # an internal moved: keep Numba's dispatch
                self._direct_failed = True
                _numba.warn_fallback(exc)
        return None

    def _name_block_limit(self, args, exc):
        """A first launch that failed asked for more threads per block than the compiled
        kernel's registers allow: say so, naming the launch's ``threads``."""
        if TARGET.name != "cuda":
            return
        error = block_limit_error(self.block, _numba.max_threads_per_block(self.kernel, args),
                                  _numba.kernel_py_func(self.kernel).__name__)
        if error is not None:
            raise error from exc


def _array_arg(param, view):
    """The kernel argument of an array parameter: Numba's array, or an
    :class:`~numba_cp.kernels.params.Address`'s ``(data address, *shape)``."""
    if isinstance(param, Address):
        if not c_contiguous(view):  # the wrappers pick these kernels for such arrays only
            raise ValueError(f"{view.name}: this kernel takes C-contiguous arrays only, got "
                             f"strides {view.strides} for shape {view.shape}")
        return (data_address(view), *view.shape)
    return view.arg


def block_limit_error(block, limit, kernel_name):
    """The ValueError for a launch of ``block`` threads per block (an int or a tuple)
    where the compiled kernel takes at most ``limit`` (None: unknown), or None."""
    threads = int(np.prod(block if isinstance(block, tuple) else (block,)))
    if limit is None or threads <= limit:
        return None
    return ValueError(f"threads: {threads} threads per block, but the compiled {kernel_name} "
                      f"launches with at most {limit} (its registers); pass threads <= {limit}")


class _DirectLaunch:
    """numba-cuda only: the compiled specialisation launched with ``cuLaunchKernel``.

    Every kernel parameter here is 8 bytes (Numba flattens an array into
    meminfo, parent, size, itemsize, data, shape..., strides...; an address
    parameter's tuple into its words; the scalars are int64), so the parameter
    block is one int64 array built once, with a pointer per parameter into it;
    a call rewrites the data pointers and launches. Should the driver call
    itself refuse its arguments, it falls back to ``cuda.core.launch`` with the
    same values.
    """

    def __init__(self, launch: KernelLaunch, args):
        import ctypes
        import threading

        self.function, self.cu_kernel = _numba.compiled_function(launch.kernel, args)
        self.driver = _driver()
        values, self.pointer_slots = [], []  # (index in values, which array)
        array_index = 0
        for param, value in zip(launch.params, args):
            if not isinstance(param, Array):
                values.append(_scalar(value))
                continue
            if isinstance(param, Address):  # (address, *shape): the address first
                self.pointer_slots.append((len(values), array_index))
                values.extend(value)
            else:
                self.pointer_slots.append((len(values) + _numba.FLATTENED_DATA_FIELD,
                                           array_index))
                values.extend(_numba.flattened_array_fields(value))
            array_index += 1
        self.values = (ctypes.c_int64 * len(values))(*values)
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * len(values))(*[base + 8 * k for k in range(len(values))])
        self.params_address = ctypes.addressof(self.params)
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        block = launch.block if isinstance(launch.block, tuple) else (launch.block,)
        self.dims = grid + tuple(block) + (1,) * (3 - len(block))
        self.lock = threading.Lock()  # the parameter block is shared by calls
        self.written = None  # the pointers the block holds, where a call gave them
        self.use_driver = True
        # Chained kernels open with chain_grids() (kernels/primitives.py): they may be
        # launched while the kernel before them on the stream still runs.
        self.chainable = getattr(_numba.kernel_py_func(launch.kernel), "chained", False)
        self.configs = {}  # stream -> its cuLaunchKernelEx configuration

    def _chained_config(self, stream):
        """The launch configuration of chained launches on ``stream``, built once per
        stream: filling one in costs more than the launch."""
        if len(self.configs) >= 16:
            self.configs.clear()
        config = self.configs[stream] = chained_launch_config(self.driver, self.dims,
                                                              stream.handle)
        return config

    def __call__(self, objects, stream, pointers=None):
        stream = resolve_stream(stream, objects[0])
        with self.lock:
            # The driver copies the parameter block at each launch, so it is rewritten only
            # when the arrays moved: a loop calls with the same buffers, and each write
            # into the ctypes block costs more than comparing the pointers.
            if pointers is None or pointers != self.written:
                for slot, i in self.pointer_slots:
                    self.values[slot] = (pointers[i] if pointers is not None
                                         else objects[i].__cuda_array_interface__["data"][0])
                # a copy: a caller may change its list in place
                self.written = None if pointers is None else pointers[:]
            if self.use_driver:
                success = self.driver.CUresult.CUDA_SUCCESS
                chain = self.chainable and chained_launches()  # may refuse the variable
                try:
                    refused = None
                    if chain:
                        config = self.configs.get(stream) or self._chained_config(stream)
                        (status,) = self.driver.cuLaunchKernelEx(
                            config, self.function, self.params_address, 0)
                        if status == success:
                            return
                        refused = status
                    # After a refused chained launch, this one tells a refusal from a fault.
                    (status,) = self.driver.cuLaunchKernel(
                        self.function, *self.dims, 0, stream.handle, self.params_address, 0)
                    if refused is not None and status == success:
                        _chaining_refused(refused)
                except (TypeError, ValueError):  # the binding refused the arguments
                    self.use_driver = False
                else:
                    if status != success:
                        raise RuntimeError(f"kernel launch failed: {status!r}")
                    return
            _numba.launch_with_cuda_core(stream, self.dims, self.cu_kernel, self.values)


def chained_launch_config(driver, dims, stream_handle):
    """``cuLaunchKernelEx``'s configuration for a launch of ``dims`` (grid x, y, z,
    block x, y, z) on ``stream_handle`` that may start before the kernel ahead of
    it on the stream has finished (programmatic stream serialization)."""
    config = driver.CUlaunchConfig()
    (config.gridDimX, config.gridDimY, config.gridDimZ,
     config.blockDimX, config.blockDimY, config.blockDimZ) = dims
    config.sharedMemBytes = 0
    config.hStream = stream_handle
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


def _scalar(value):
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("boolean kernel scalars are not used here")
    return int(value)
