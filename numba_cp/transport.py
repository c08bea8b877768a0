"""All-gather transports over an mpi4py communicator.

Each rank's ``send`` array of shape ``S`` becomes ``recv`` of shape
``(comm.size, *S)`` on every rank, written into a caller-owned buffer
(``shared/SPEC.md``, "All-gather"). Only bytes move: any plain-data dtype works,
NumPy's ``float16`` included; for bf16 pass a ``uint16`` view.

One small class per way of moving the bytes, chosen once per communicator:

:class:`HostMPI`
    host NumPy arrays straight into ``comm.Allgather`` (the simulator, CPU data).
:class:`DeviceMPI`
    GPU-aware (CUDA- or ROCm-aware) MPI: device buffers go straight to
    ``comm.Allgather``, after the producing stream is synchronized.
:class:`StagedMPI`
    MPI that cannot read device memory: pinned host buffers allocated once at
    :meth:`~Transport.setup`; per call a device-to-pinned copy on the stream,
    a stream sync, ``Allgather`` on the host buffers and a pinned-to-device copy
    on the stream. Nothing is allocated per call.
:class:`IPCAllGather` (``"ipc"``)
    ranks of one node: every rank maps every peer's exchange buffer (CUDA/HIP
    IPC through CuPy) and the gather is three kernels on the stream -- push
    the payload into every peer, signal, wait for every peer and copy out --
    synchronised by device-side epochs and flags, so it can be captured in a
    CUDA/HIP graph. Protocol and race analysis: :mod:`numba_cp.kernels.ipc`.
    Under the simulator (forced only) host shared memory stands in for IPC.
:class:`NCCLAllGather` (``"nccl"``)
    ``ncclAllGather`` (RCCL on AMD) through ``cupy.cuda.nccl``; capturable.
    Opt-in only: NCCL refuses two ranks on one GPU.

Every transport has the same life cycle::

    t = choose_transport(comm, device=True)   # or StagedMPI(comm), ...
    t.setup((heads, tokens, topk), np.int64)   # collective: every rank calls it
    t.all_gather(send, recv, stream=None)      # collective; returns recv
    t.teardown()

or ``with StagedMPI(comm).setup(shape, dtype) as t: ...``. :meth:`~Transport.setup`
checks with one tiny ``comm.allgather`` that every rank asked for the same
shape and dtype and raises the same ``ValueError`` on every rank otherwise, so
a mismatch cannot hang the collective. The per-call checks of
:meth:`~Transport.all_gather` are local and raise before any communication.

The MPI transports block the host on the stream and on MPI, so they cannot be
captured in a CUDA/HIP graph; the device-side ones (IPC, NCCL) can
(``capturable``). More can register themselves in :data:`TRANSPORTS` with
:func:`register_transport`.

:func:`choose_transport` with ``device=True`` picks, the same on every rank:
IPC when every rank of the communicator is on one node and every rank can
map every rank's GPU memory (:func:`ipc_verdict`, collective); else
GPU-aware MPI; else staged.

GPU-aware detection (:func:`gpu_aware_mpi`) asks the loaded MPI library through
ctypes, since mpi4py has no query: ``NUMBA_CP_GPU_AWARE_MPI=0|1`` forces the
answer; Cray MPICH is GPU-aware when ``MPICH_GPU_SUPPORT_ENABLED=1``; MPICH
(4.0 and later) answers ``MPIX_GPU_query_support``; Open MPI answers
``MPIX_Query_cuda_support`` / ``MPIX_Query_rocm_support`` (its ``mpi-ext.h``
extensions). ``NUMBA_CP_TRANSPORT=<name>`` overrides :func:`choose_transport`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys

import numpy as np

from . import ipc as _ipc
from .arrays import as_kernel_array, device_copy, resolve_stream
from .errors import RankAgreementError
from .backend import NAME, cuda, is_simulator

__all__ = [
    "Transport", "HostMPI", "DeviceMPI", "StagedMPI", "IPCAllGather", "NCCLAllGather",
    "IPCTimeoutError", "TRANSPORTS", "register_transport", "choose_transport",
    "requested_transport", "takes_device_arrays", "gpu_aware_mpi", "ipc_verdict",
    "GPU_AWARE_ENV", "TRANSPORT_ENV",
]

GPU_AWARE_ENV = "NUMBA_CP_GPU_AWARE_MPI"
TRANSPORT_ENV = "NUMBA_CP_TRANSPORT"

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


def _mpi():
    from mpi4py import MPI  # optional dependency: only the transports need it

    return MPI


# ---------------------------------------------------------------------------
# GPU-aware MPI detection


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
    MPI = _mpi()
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
def _probe(backend_name: str) -> tuple[bool, str]:
    MPI = _mpi()
    version = MPI.Get_library_version().replace("\x00", "").strip()
    library = " ".join(version.splitlines()[0].split()) if version else "the MPI library"
    if "CRAY MPICH" in version.upper():
        raw = os.environ.get("MPICH_GPU_SUPPORT_ENABLED", "")
        if raw.strip() == "1":
            return True, f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1 ({library})"
        return False, (f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED={raw!r}; set it to 1 (and "
                       f"link the GTL library) for GPU-aware MPI ({library})")
    handles = _libmpi_handles()
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


def gpu_aware_mpi(backend_name: str | None = None) -> tuple[bool, str]:
    """Whether the loaded MPI library reads device memory of ``backend_name``'s GPUs.

    Returns ``(answer, reason)``; ``backend_name`` defaults to the active backend
    (:data:`numba_cp.backend.NAME`). ``NUMBA_CP_GPU_AWARE_MPI=0|1`` forces the
    answer. MPI must be initialized (importing ``mpi4py.MPI`` does that).
    """
    backend_name = NAME if backend_name is None else backend_name
    if backend_name not in ("cuda", "hip", "sim"):
        raise ValueError(f"backend_name: expected 'cuda', 'hip' or 'sim', got {backend_name!r}")
    forced = _env_flag(GPU_AWARE_ENV)
    if forced is not None:
        return forced, f"forced by {GPU_AWARE_ENV}={os.environ[GPU_AWARE_ENV].strip()}"
    if backend_name == "sim":
        return False, "the sim backend has no device memory for MPI to read"
    MPI = _mpi()
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return False, "MPI is not initialized, so the library cannot be asked"
    return _probe(backend_name)


# ---------------------------------------------------------------------------
# Buffers


class _ByteView:
    """``nbytes`` of device memory at ``pointer`` as a 1-D uint8 CUDA array interface."""

    def __init__(self, pointer, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
            "strides": None, "stream": None, "version": 3}


def _device_pointer(view) -> int:
    interface = getattr(view, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0] or 0)
    pointer = view.device_ctypes_pointer
    return int(getattr(pointer, "value", pointer) or 0)


def _synchronize(stream):
    if hasattr(stream, "synchronize"):
        stream.synchronize()  # the simulator's stream is 0: everything already ran


def _shape_problem(shape):
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        return None, f"shape {shape!r} is not a tuple of integers"
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in dims):
        return None, f"shape {shape!r} is not a tuple of integers"
    dims = tuple(int(n) for n in dims)
    if any(n < 0 for n in dims):
        return None, f"shape {dims} has a negative extent"
    return dims, None


def _dtype_problem(dtype):
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        return None, f"dtype {dtype!r} is not a NumPy dtype ({exc})"
    if dtype.hasobject:
        return None, f"dtype {dtype} holds Python objects; only plain-data dtypes move as bytes"
    return dtype, None


def _rank_list(ranks):
    return ", ".join(str(r) for r in ranks)


# ---------------------------------------------------------------------------
# Transports


class Transport:
    """The life cycle shared by all transports: setup, all_gather, teardown.

    ``device`` says whether the transport takes device arrays (True) or host
    NumPy arrays (False). Subclasses implement ``_setup``, ``_teardown`` and
    ``_all_gather``.
    """

    name = ""
    device = False
    # Whether all_gather only queues device work on the stream (so a CUDA/HIP graph
    # can capture it). MPI calls block the host: none of these transports can.
    capturable = False

    def __init__(self, comm):
        self.comm = comm
        self.reason = ""  # why choose_transport picked it, for logs
        self.shape = None
        self.dtype = None
        self.recv_shape = None
        self.nbytes = 0

    # -- life cycle ---------------------------------------------------------

    @property
    def is_setup(self) -> bool:
        return self.shape is not None

    def setup(self, shape, dtype):
        """Prepare for ``send`` of ``shape``/``dtype``; collective over ``comm``.

        Raises ``ValueError`` on every rank if any rank's ``shape`` or ``dtype``
        is invalid or differs from another rank's. Returns ``self``.
        """
        if self.is_setup:
            raise RuntimeError(f"{self.name}: already set up; call teardown() first")
        dims, problem = _shape_problem(shape)
        dtype, dtype_problem = _dtype_problem(dtype)
        problem = problem or dtype_problem
        mine = (dims if dims is not None else repr(shape),
                dtype.str if dtype is not None else None, problem)
        everyone = self.comm.allgather(mine)
        problems = [(rank, p) for rank, (_, _, p) in enumerate(everyone) if p]
        if problems:
            raise RankAgreementError(f"{self.name} setup: " + "; ".join(
                f"rank {rank}: {p}" for rank, p in problems))
        groups: dict = {}
        for rank, (s, d, _) in enumerate(everyone):
            groups.setdefault((tuple(s), d), []).append(rank)
        if len(groups) > 1:
            raise RankAgreementError(
                f"{self.name} setup: ranks disagree on the all-gather buffer (every rank "
                "must set up the same shape and dtype): " + "; ".join(
                    f"shape {s} dtype {np.dtype(d)} on rank(s) {_rank_list(ranks)}"
                    for (s, d), ranks in groups.items()))
        self.shape = dims
        self.dtype = dtype
        self.recv_shape = (self.comm.Get_size(),) + dims
        self.nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        try:
            self._setup()
        except BaseException:
            self.shape = self.dtype = self.recv_shape = None
            raise
        return self

    def teardown(self):
        """Release what :meth:`setup` took; safe to call twice. Local (not collective)."""
        if self.is_setup:
            try:
                self._teardown()
            finally:
                self.shape = self.dtype = self.recv_shape = None
                self.nbytes = 0

    def all_gather(self, send, recv, stream=None):
        """Gather every rank's ``send`` into ``recv[rank]`` on all ranks; returns ``recv``.

        ``send`` must have the shape and dtype given to :meth:`setup`, ``recv``
        shape ``(comm.size, *shape)`` and the same dtype; both C-contiguous.
        ``stream`` is the stream that produced ``send`` and will consume ``recv``
        (device transports; see :func:`numba_cp.arrays.resolve_stream`).
        """
        if not self.is_setup:
            raise RuntimeError(f"{self.name}: call setup(shape, dtype) before all_gather")
        return self._all_gather(send, recv, stream)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.teardown()
        return False

    def __repr__(self):
        state = (f"shape={self.shape}, dtype={self.dtype}" if self.is_setup else "not set up")
        return f"<{type(self).__name__} {self.name!r} size={self.comm.Get_size()} {state}>"

    # -- checks -------------------------------------------------------------

    def _check(self, name, shape, dtype, contiguous):
        want = self.shape if name == "send" else self.recv_shape
        shape = tuple(int(n) for n in shape)
        if shape != want:
            hint = "" if name == "send" else " (comm.size, *shape)"
            raise ValueError(f"{name}: shape {shape} but the {self.name} transport was set up "
                             f"for {want}{hint}")
        if np.dtype(dtype) != self.dtype:
            raise TypeError(f"{name}: dtype {np.dtype(dtype)} but the {self.name} transport "
                            f"was set up for {self.dtype}")
        if not contiguous:
            raise ValueError(f"{name}: must be C-contiguous")

    def _check_host(self, obj, name):
        if not isinstance(obj, np.ndarray):
            if hasattr(obj, "__cuda_array_interface__") or getattr(obj, "__cuda_ndarray__", False):
                raise TypeError(f"{name}: a device array was given to the {self.name} "
                                "transport, which takes host NumPy arrays")
            raise TypeError(f"{name}: expected a NumPy array, got {type(obj).__name__}")
        self._check(name, obj.shape, obj.dtype, obj.flags.c_contiguous)
        if name == "recv" and not obj.flags.writeable:
            raise ValueError("recv: is read-only")
        return obj

    def _device_view(self, obj, name):
        """A Numba device-array view of ``obj`` (the simulator's fake one there)."""
        if isinstance(obj, np.ndarray):
            raise TypeError(f"{name}: a host NumPy array was given to the {self.name} "
                            "transport, which takes device arrays")
        if is_simulator:
            if not getattr(obj, "__cuda_ndarray__", False):
                raise TypeError(f"{name}: expected a simulator device array "
                                f"(numba.cuda.to_device), got {type(obj).__name__}")
            view = obj
        else:
            view = as_kernel_array(obj, name).arg
        self._check(name, view.shape, view.dtype, view.is_c_contiguous())
        return view

    def _check_disjoint(self, send_range, recv_range):
        (s0, sn), (r0, rn) = send_range, recv_range
        if sn and rn and s0 < r0 + rn and r0 < s0 + sn:
            raise ValueError("recv: overlaps send; the all-gather is not done in place")

    # -- subclass hooks -----------------------------------------------------

    def _setup(self):
        pass

    def _teardown(self):
        pass

    def _all_gather(self, send, recv, stream):
        raise NotImplementedError


TRANSPORTS: dict[str, type[Transport]] = {}


def register_transport(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make ``cls`` choosable by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a transport needs a name")
    if TRANSPORTS.get(cls.name, cls) is not cls:
        raise ValueError(f"transport name {cls.name!r} is taken by "
                         f"{TRANSPORTS[cls.name].__name__}")
    TRANSPORTS[cls.name] = cls
    return cls


def _host_range(array):
    return array.__array_interface__["data"][0], array.nbytes


@register_transport
class HostMPI(Transport):
    """Host NumPy arrays straight into ``comm.Allgather``."""

    name = "host"
    device = False

    def _all_gather(self, send, recv, stream):
        send = self._check_host(send, "send")
        recv = self._check_host(recv, "recv")
        self._check_disjoint(_host_range(send), _host_range(recv))
        BYTE = _mpi().BYTE
        self.comm.Allgather([send, BYTE], [recv, BYTE])
        return recv


@register_transport
class DeviceMPI(Transport):
    """GPU-aware MPI: device buffers straight into ``comm.Allgather``.

    The stream is synchronized first, so ``send`` is complete when MPI reads
    it; ``recv`` is complete when the call returns. Under the simulator the
    fake device arrays are host memory, which MPI reads directly.
    """

    name = "mpi-device"
    device = True

    def _buffer(self, view, nbytes):
        if is_simulator:
            host = np.asarray(view)  # the fake device array's own memory, not a copy
            return host, (host.__array_interface__["data"][0], nbytes)
        pointer = _device_pointer(view)
        return _ByteView(pointer, nbytes), (pointer, nbytes)

    def _all_gather(self, send, recv, stream):
        send_view = self._device_view(send, "send")
        recv_view = self._device_view(recv, "recv")
        send_buf, send_range = self._buffer(send_view, self.nbytes)
        recv_buf, recv_range = self._buffer(recv_view, self.nbytes * self.comm.Get_size())
        self._check_disjoint(send_range, recv_range)
        _synchronize(resolve_stream(stream))
        BYTE = _mpi().BYTE
        self.comm.Allgather([send_buf, BYTE], [recv_buf, BYTE])
        return recv


@register_transport
class StagedMPI(Transport):
    """MPI that cannot read device memory: through pinned host buffers made at setup.

    Per call: ``send`` → pinned copy on the stream, stream sync, ``Allgather``
    between pinned buffers, pinned → ``recv`` copy on the stream (not waited
    for: later work on the same stream sees ``recv``). An event recorded after
    that copy keeps the next call from overwriting the pinned buffer while the
    copy may still read it.
    """

    name = "staged"
    device = True

    def __init__(self, comm):
        super().__init__(comm)
        self._send_host = self._recv_host = self._copied = None
        self._pending = False

    def _setup(self):
        # A zero-byte pinned allocation is a null pointer NumPy refuses; nothing is copied then.
        allocate = cuda.pinned_array if self.nbytes else np.empty
        self._send_host = allocate(self.shape, dtype=self.dtype)
        self._recv_host = allocate(self.recv_shape, dtype=self.dtype)
        self._copied = cuda.event() if is_simulator else cuda.event(timing=False)
        self._pending = False

    def _teardown(self):
        if self._pending:
            self._copied.synchronize()
        self._send_host = self._recv_host = self._copied = None
        self._pending = False

    def _all_gather(self, send, recv, stream):
        send_view = self._device_view(send, "send")
        recv_view = self._device_view(recv, "recv")
        if is_simulator:
            ranges = [(np.asarray(v).__array_interface__["data"][0], v.nbytes)
                      for v in (send_view, recv_view)]
        else:
            ranges = [(_device_pointer(v), v.nbytes) for v in (send_view, recv_view)]
        self._check_disjoint(*ranges)
        stream = resolve_stream(stream)
        if self.nbytes:
            send_view.copy_to_host(self._send_host, stream=stream)
        _synchronize(stream)
        if self._pending:  # the last call's pinned → device copy, maybe on another stream
            self._copied.synchronize()
            self._pending = False
        BYTE = _mpi().BYTE
        self.comm.Allgather([self._send_host, BYTE], [self._recv_host, BYTE])
        if self.nbytes:
            recv_view.copy_to_device(self._recv_host, stream=stream)
            self._copied.record(stream)
            self._pending = True
        return recv


def _view_range(view):
    """``(address, nbytes)`` of a validated device view (the simulator's: host memory)."""
    if is_simulator:
        return np.asarray(view).__array_interface__["data"][0], view.nbytes
    return _device_pointer(view), view.nbytes


def _stream_handle(stream) -> int:
    """The raw CUDA/HIP stream handle of ``stream`` (see :func:`resolve_stream`)."""
    if is_simulator:
        return 0
    if stream is None:
        cupy = sys.modules.get("cupy")
        return int(cupy.cuda.get_current_stream().ptr) if cupy is not None else 0
    for attribute in ("ptr", "cuda_stream"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    handle = getattr(stream, "handle", None)  # a Numba stream
    if handle is not None:
        handle = getattr(handle, "value", handle)
        return int(handle or 0)
    raise TypeError(f"stream: expected a Numba, CuPy or PyTorch stream or an int handle, "
                    f"got {type(stream).__name__}")


def _agree_or_raise(comm, what: str, problem: str | None, payload=None, cleanup=None):
    """Every rank's ``(problem, payload)``; the same error on every rank if any failed."""
    everyone = comm.allgather((problem, payload))
    problems = [(rank, p) for rank, (p, _) in enumerate(everyone) if p]
    if problems:
        if cleanup is not None:
            cleanup()
        raise RankAgreementError(f"{what}: " + "; ".join(
            f"rank {rank}: {p}" for rank, p in problems))
    return [payload for _, payload in everyone]


def _problem(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class IPCTimeoutError(RuntimeError):
    """An IPC all-gather gave up waiting for a peer; what it gathered since is garbage."""


@register_transport
class IPCAllGather(Transport):
    """Ranks of one node gather by writing straight into each other's GPU memory.

    :meth:`setup` (collective) allocates this rank's exchange buffer (flags and
    two halves of ``world`` payload slots, :class:`numba_cp.ipc.IPCLayout`),
    exports its IPC handle, exchanges the handles with ``comm.allgather``,
    opens every peer's (``cudaIpcMemLazyEnablePeerAccess``) and zeroes a
    private control block holding the device-side epoch. Each
    :meth:`all_gather` then queues three kernels on ``stream`` and returns at
    once: no host synchronisation, allocation or decision from device values,
    so it can be captured in a CUDA/HIP graph and replayed (the epoch moves on
    on the device). Consecutive calls must be ordered (same stream, or
    streams the caller orders). Protocol, race analysis and failure handling:
    :mod:`numba_cp.kernels.ipc`.

    Args:
        comm: ranks that all run on one node.
        spin_limit: polls before a wait gives up (default
            ``NUMBA_CP_IPC_SPIN_LIMIT`` or :data:`numba_cp.ipc.SPIN_LIMIT`); a
            wait that gives up records an error that :meth:`check` raises.

    Under the simulator (when forced) the buffers are host shared memory
    (:class:`numba_cp.ipc.HostIPCMemory`) and the same kernels run on it.
    :meth:`teardown` is local: it waits for this rank's device work, closes the
    peers' handles and frees its own buffer.
    """

    name = "ipc"
    device = True
    capturable = True

    def __init__(self, comm, *, spin_limit: int | None = None):
        super().__init__(comm)
        self.spin_limit = _ipc.spin_limit_from_env() if spin_limit is None else int(spin_limit)
        if self.spin_limit < 1:
            raise ValueError(f"spin_limit must be >= 1, got {spin_limit}")
        self.layout = None
        self.engine = None
        self._memory = None
        self._regions = []

    def _setup(self):
        comm = self.comm
        rank, world = comm.Get_rank(), comm.Get_size()
        self.layout = layout = _ipc.IPCLayout(world, self.nbytes)
        if self.nbytes == 0:
            return  # every rank agreed on the shape: nothing ever moves
        regions = [None] * world
        self._regions = regions
        problem = handle = ctrl = None
        try:
            self._memory = memory = _ipc.ipc_memory()
            regions[rank] = memory.allocate(layout.total_bytes)
            handle = memory.handle(regions[rank])
            from .kernels.ipc import CTRL_WORDS

            ctrl = memory.private_zeros(CTRL_WORDS, np.int64)
            memory.synchronize()
        except Exception as exc:
            problem = _problem(exc)
        handles = _agree_or_raise(comm, "ipc setup (allocating and exporting the exchange "
                                  "buffers)", problem, handle, cleanup=self._release)
        problem = None
        try:
            for peer in range(world):
                if peer != rank:  # a process cannot open its own IPC handle
                    regions[peer] = memory.open(handles[peer], layout.total_bytes)
            engine = _ipc.IPCEngine(rank, world, layout, regions, ctrl,
                                    spin_limit=self.spin_limit)
        except Exception as exc:
            problem = _problem(exc)
        _agree_or_raise(comm, "ipc setup (opening the peers' exchange buffers)", problem,
                        cleanup=self._release)
        memory.published(regions[rank])
        self.engine = engine

    def _release(self):
        """Close the peers' buffers, free this rank's (errors collected, first re-raised)."""
        errors = []
        memory, regions = self._memory, self._regions
        rank = self.comm.Get_rank()
        self.engine = None
        self._regions = []
        if memory is not None:
            order = [q for q in range(len(regions)) if q != rank] + [rank]
            for q in order:
                if q < len(regions) and regions[q] is not None:
                    try:
                        memory.release(regions[q])
                    except Exception as exc:
                        errors.append(exc)
        self._memory = None
        if errors:
            raise errors[0]

    def _teardown(self):
        try:
            if self._memory is not None and self.engine is not None:
                self._memory.synchronize()  # this rank's last gather is done with the buffers
        finally:
            self._release()
            self.layout = None

    def _all_gather(self, send, recv, stream):
        send_view = self._device_view(send, "send")
        recv_view = self._device_view(recv, "recv")
        send_range, recv_range = _view_range(send_view), _view_range(recv_view)
        self._check_disjoint(send_range, recv_range)
        if self.nbytes == 0:
            return recv
        engine = self.engine
        unit = engine.unit_for(self.nbytes, send_range[0], recv_range[0])
        flat_send = engine.flat(send_view, send_range[0], self.nbytes, unit)
        flat_recv = engine.flat(recv_view, recv_range[0], recv_range[1], unit)
        engine.all_gather(flat_send, flat_recv, unit, resolve_stream(stream))
        return recv

    # -- inspection (host synchronisation: not for the hot path) ------------------

    def state(self) -> dict:
        """This rank's epoch, error words and flags (waits for its device work)."""
        if not self.is_setup:
            raise RuntimeError(f"{self.name}: call setup(shape, dtype) first")
        if self.engine is None:  # a zero-byte payload
            return dict(epoch=0, error_epoch=0, error_peer=-1, poisoned_by=-1, flags=[])
        self._memory.synchronize()
        return self.engine.state()

    def check(self):
        """Raise :class:`IPCTimeoutError` if a wait on this rank gave up, or a peer's did.

        Waits for this rank's device work. Returns the :meth:`state` otherwise.
        """
        state = self.state()
        rank = self.comm.Get_rank()
        if state["error_epoch"]:
            raise IPCTimeoutError(
                f"ipc rank {rank}: call {state['error_epoch']} gave up waiting for rank "
                f"{state['error_peer']} after {self.spin_limit} polls; results from that "
                "call on are unreliable")
        if state["poisoned_by"] >= 0:
            raise IPCTimeoutError(
                f"ipc rank {rank}: rank {state['poisoned_by']} gave up waiting for a peer; "
                "results since are unreliable")
        return state


def _nccl_module():
    """``cupy.cuda.nccl`` (RCCL under cupy-rocm); tests replace this function."""
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise ImportError("cupy.cuda.nccl: CuPy was built without NCCL")
    return nccl


def _scratch(nbytes: int):
    """A zeroed device byte buffer and its address (a simulator array there)."""
    buffer = device_copy(np.zeros(max(nbytes, 1), np.uint8), simulated_device=True)
    if is_simulator:
        return buffer, np.asarray(buffer).__array_interface__["data"][0]
    return buffer, int(buffer.data.ptr)


@register_transport
class NCCLAllGather(Transport):
    """``ncclAllGather`` on bytes, through ``cupy.cuda.nccl`` (RCCL on AMD).

    :meth:`setup` (collective): rank 0 makes the unique id, ``comm.bcast``
    shares it, every rank builds ``NcclCommunicator(world, uid, rank)`` on its
    current device, and one warm-up all-gather of the real payload size runs
    and is waited for -- NCCL connects lazily, and connecting inside a graph
    capture hangs. Each :meth:`all_gather` is one ``allGather`` on the stream;
    capturable. Never chosen automatically: force ``nccl`` (NCCL refuses two
    ranks on one GPU).
    """

    name = "nccl"
    device = True
    capturable = True

    def __init__(self, comm):
        super().__init__(comm)
        self._nccl = None
        self._comm = None

    def _setup(self):
        comm = self.comm
        rank, world = comm.Get_rank(), comm.Get_size()
        problem = uid = None
        try:
            nccl = _nccl_module()
            if rank == 0:
                uid = nccl.get_unique_id()
        except Exception as exc:
            problem = _problem(exc)
        # Before NCCL's own (blocking) init: a rank that cannot even start must
        # not leave the others waiting in ncclCommInitRank.
        _agree_or_raise(comm, "nccl setup (loading NCCL)", problem)
        uid = comm.bcast(uid, root=0)
        problem = None
        try:
            self._nccl = nccl
            self._comm = nccl.NcclCommunicator(world, uid, rank)
            if self.nbytes:
                send, send_ptr = _scratch(self.nbytes)
                recv, recv_ptr = _scratch(self.nbytes * world)
                stream, handle = self._warmup_stream()
                self._comm.allGather(send_ptr, recv_ptr, self.nbytes, nccl.NCCL_UINT8, handle)
                _synchronize(stream)
                del send, recv
        except Exception as exc:
            problem = _problem(exc)
        _agree_or_raise(comm, "nccl setup (communicator and warm-up)", problem,
                        cleanup=self._destroy)

    @staticmethod
    def _warmup_stream():
        if is_simulator:
            return 0, 0
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        return stream, int(stream.ptr)

    def _destroy(self):
        nccl_comm, self._comm = self._comm, None
        if nccl_comm is not None:
            nccl_comm.destroy()

    def _teardown(self):
        self._destroy()
        self._nccl = None

    def _all_gather(self, send, recv, stream):
        send_view = self._device_view(send, "send")
        recv_view = self._device_view(recv, "recv")
        send_range, recv_range = _view_range(send_view), _view_range(recv_view)
        self._check_disjoint(send_range, recv_range)
        if self.nbytes:
            self._comm.allGather(send_range[0], recv_range[0], self.nbytes,
                                 self._nccl.NCCL_UINT8, _stream_handle(stream))
        return recv


# ---------------------------------------------------------------------------
# Choosing


def requested_transport(force: str | None = None) -> tuple[str | None, str]:
    """The transport asked for, and by whom: ``force``, else ``NUMBA_CP_TRANSPORT``."""
    if force is not None:
        return force, "force"
    env = os.environ.get(TRANSPORT_ENV, "").strip()
    return (env, TRANSPORT_ENV) if env else (None, "")


def takes_device_arrays(force: str | None = None) -> bool | None:
    """Whether the requested transport takes device arrays; None if none (or no such) is named."""
    name, _ = requested_transport(force)
    cls = TRANSPORTS.get(str(name).strip().lower()) if name is not None else None
    return None if cls is None else cls.device


# Probes, one function each so tests can replace them.


def ipc_probe() -> tuple[bool, str]:
    """Whether this process can share GPU memory by IPC (local): ``(answer, reason)``."""
    return _ipc.local_probe()


def _gpu_identity():
    return _ipc.gpu_identity()


def _peer_access(identities) -> tuple[bool, str]:
    return _ipc.peer_access(identities)


def _shared_node(comm) -> bool:
    """Whether every rank of ``comm`` is in one shared-memory domain (collective)."""
    MPI = _mpi()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size() == comm.Get_size()
    finally:
        local.Free()


def _processor_name() -> str:
    return _mpi().Get_processor_name()


def _summarise(failures) -> str:
    """``rank r: why`` for each failing rank, or one line when they all say the same."""
    reasons = {why for _, why in failures}
    if len(reasons) == 1:
        ranks = [rank for rank, _ in failures]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_rank_list(ranks)}"
        return f"{who}: {reasons.pop()}"
    return "; ".join(f"rank {rank}: {why}" for rank, why in failures)


def ipc_verdict(comm) -> tuple[bool, str]:
    """Whether :class:`IPCAllGather` can serve ``comm``: the same answer on every rank.

    Collective (for more than one rank): every rank must be on one node
    (``Split_type(COMM_TYPE_SHARED)`` spans the whole communicator), pass
    :func:`ipc_probe` (CuPy with the IPC functions, a real GPU backend) and be
    able to map every other rank's GPU (peer access between their PCI bus
    ids). The local answers are all-gathered, so every rank decides alike.
    """
    world = comm.Get_size()
    if world < 2:
        return False, "a single rank has no peer to map"
    ok, why = ipc_probe()
    identity = _gpu_identity() if ok else None
    shared = _shared_node(comm)
    everyone = comm.allgather((bool(ok), str(why), identity, _processor_name()))
    hosts = sorted({host for *_, host in everyone})
    if not shared:
        return False, f"the ranks span more than one node ({', '.join(hosts)})"
    failures = [(rank, w) for rank, (o, w, _, _) in enumerate(everyone) if not o]
    if failures:
        return False, _summarise(failures)
    reachable, how = _peer_access([identity for _, _, identity, _ in everyone])
    verdicts = comm.allgather((bool(reachable), str(how)))
    failures = [(rank, w) for rank, (o, w) in enumerate(verdicts) if not o]
    if failures:
        return False, _summarise(failures)
    return True, (f"all {world} ranks on node {hosts[0]} map each other's GPU memory "
                  f"({verdicts[0][1]}; {everyone[0][1]})")


def choose_transport(comm, *, device: bool, force: str | None = None) -> Transport:
    """The transport for ``comm``: not set up yet (call ``setup`` on every rank).

    ``device=False`` (host NumPy arrays) gives :class:`HostMPI`. ``device=True``
    gives :class:`IPCAllGather` when :func:`ipc_verdict` says every rank can
    map every other's GPU memory (collective for more than one rank: every
    rank must call it), else :class:`DeviceMPI` if :func:`gpu_aware_mpi` says
    so, else :class:`StagedMPI`; :class:`NCCLAllGather` only when forced.
    ``force`` (or ``NUMBA_CP_TRANSPORT`` when ``force`` is None) names a
    transport from :data:`TRANSPORTS` instead; it must take the kind of array
    ``device`` says.
    """
    force, source = requested_transport(force)
    if force is not None:
        cls = TRANSPORTS.get(str(force).strip().lower())
        if cls is None:
            raise ValueError(f"{source}={force!r}: unknown transport; choose one of "
                             f"{', '.join(sorted(TRANSPORTS))}")
        if cls.device != bool(device):
            kind = "device" if cls.device else "host NumPy"
            raise ValueError(f"{source}={force!r}: the {cls.name} transport takes {kind} "
                             f"arrays but device={bool(device)} was asked for")
        transport = cls(comm)
        transport.reason = f"forced by {source}={force}"
        return transport
    if not device:
        transport = HostMPI(comm)
        transport.reason = "host arrays"
        return transport
    ipc_ok, ipc_why = ipc_verdict(comm)
    if ipc_ok:
        transport = IPCAllGather(comm)
        transport.reason = f"IPC: {ipc_why}"
        return transport
    aware, why = gpu_aware_mpi(NAME)
    transport = DeviceMPI(comm) if aware else StagedMPI(comm)
    transport.reason = ("GPU-aware MPI: " if aware else "MPI not GPU-aware: ") + why
    if comm.Get_size() > 1:
        transport.reason += f"; no IPC: {ipc_why}"
    return transport
