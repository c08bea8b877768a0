"""The IPC transport (``"ipc"``): ranks of one node write straight into each other's GPU memory.

Every rank maps every peer's exchange buffer (CUDA/HIP IPC through CuPy) and
the gather is three kernels on the stream -- push the payload into every
peer, signal, wait for every peer and copy out -- synchronised by device-side
epochs and flags, so it can be captured in a CUDA/HIP graph. Protocol, race
analysis and failure handling: :mod:`numba_cp.kernels.ipc`.

The pieces, so that tests can drive them directly (several simulated ranks in
one process):

:class:`IPCLayout`
    where the flags and the two payload halves sit in a rank's exchange buffer.
:class:`CudaIPCMemory`, :class:`HostIPCMemory`
    allocate a buffer, export a handle (bytes) for it, open a peer's handle,
    view a byte range as a kernel array, close and free. ``CudaIPCMemory``
    uses CuPy's ``cudaIpc*`` / ``hipIpc*`` wrappers; ``HostIPCMemory`` stands
    in for it under the simulator with a file in ``/dev/shm`` mapped by every
    rank, so the same protocol runs across real processes on a CPU.
:class:`IPCEngine`
    one rank's view of every exchange buffer plus its private control words;
    ``all_gather`` queues the three launches.
:class:`IPCAllGather`
    the transport built from them.
:func:`local_probe`, :func:`gpu_identity`, :func:`peer_access`
    what :func:`numba_cp.comm.choose.ipc_verdict` asks each rank.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import tempfile

from typing import Callable, NamedTuple

import numpy as np

from .._numba import simulated_device_view
from ..arrays import device_view, fixed_view, resolve_stream
from ..backend import COMPILE_ONLY, TARGET, cuda
from ..errors import IPCTimeoutError
from ..kernels import ipc as K
from ..launcher import KernelLaunch, array_signature
from . import _hip
from .base import (Transport, agree, check_apart, describe_problem, register_transport,
                   seconds_from_env)

__all__ = ["IPCLayout", "CudaIPCMemory", "HostIPCMemory", "IPCEngine", "IPCAllGather", "Delivery",
           "ipc_memory", "local_probe", "gpu_identity", "peer_access", "TIMEOUT_ENV", "WAIT_ENV",
           "merge_waits", "wait_setting",
           "DEFAULT_TIMEOUT_S", "timeout_from_env"]

TIMEOUT_ENV = "NUMBA_CP_IPC_TIMEOUT"
WAIT_ENV = "NUMBA_CP_IPC_WAIT"
# Seconds a device-side wait polls for its peers before it gives up. Far beyond
# the skew between ranks in steady state (microseconds), yet a dead peer costs
# seconds, not a hung job. The first gathers after setup wait for the peers'
# first kernel compilations too, which take tens of seconds on the simulator.
DEFAULT_TIMEOUT_S = 60.0 if TARGET.simulator else 5.0

ALIGN = 256  # byte alignment of the flag area and of every payload slot
VIEW_CACHE = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class IPCLayout:
    """Byte layout of one rank's exchange buffer for ``world`` ranks of ``nbytes``.

    ``[0, flag_bytes)``: int64 flags, ``world + 1`` of them (the last is the
    poison word); then ``data``: two halves of ``world`` slots of
    ``slot_bytes`` (``nbytes`` rounded up to :data:`ALIGN`).
    """

    def __init__(self, world: int, nbytes: int):
        self.world = int(world)
        self.nbytes = int(nbytes)
        self.flag_words = self.world + 1
        self.flag_bytes = _round_up(8 * self.flag_words, ALIGN)
        self.slot_bytes = _round_up(max(self.nbytes, 1), ALIGN)
        self.data_bytes = 2 * self.world * self.slot_bytes
        self.total_bytes = self.flag_bytes + self.data_bytes

    def slot_offset(self, epoch: int, rank: int) -> int:
        """Byte offset (within ``data``) of ``rank``'s payload of call ``epoch``."""
        return K.slot_base(int(epoch), self.world, int(rank), self.slot_bytes)

    def __repr__(self):
        return (f"IPCLayout(world={self.world}, nbytes={self.nbytes}, "
                f"total_bytes={self.total_bytes})")


# ---------------------------------------------------------------------------
# Shared device memory


class _Region:
    """A byte range some :class:`*IPCMemory` allocated or opened."""

    def __init__(self, memory, pointer, nbytes, owned, keep=None):
        self.memory = memory
        self.pointer = pointer  # device address (GPU) or host address (simulator)
        self.nbytes = nbytes
        self.owned = owned
        self.keep = keep  # whatever must stay alive with the mapping
        self._views = []

    def view(self, offset: int, count: int, dtype):
        """``count`` elements of ``dtype`` at byte ``offset`` as a kernel array."""
        dtype = np.dtype(dtype)
        return self.strided_view(offset, (count,), (dtype.itemsize,), dtype)

    def strided_view(self, offset: int, shape, strides, dtype):
        """An array of ``shape`` with byte ``strides`` (non-negative) at byte ``offset``."""
        dtype = np.dtype(dtype)
        end = offset + sum((n - 1) * st for n, st in zip(shape, strides)) + dtype.itemsize
        if offset < 0 or (all(shape) and end > self.nbytes):
            raise ValueError(f"view [{offset}, {end}) outside the {self.nbytes}-byte region")
        return self.memory.view(self, offset, tuple(shape), tuple(strides), dtype)


class CudaIPCMemory:
    """CUDA/HIP IPC through CuPy's runtime wrappers (``cupy.cuda.runtime``).

    Buffers come from ``runtime.malloc`` itself, not CuPy's memory pool: an IPC
    handle names a whole allocation, and a pool hands out pieces of larger ones.
    On HIP they are uncached device memory (:func:`numba_cp.comm._hip.malloc_uncached`).
    """

    kind = "cuda-ipc"

    def __init__(self):
        import cupy

        self.runtime = cupy.cuda.runtime

    def allocate(self, nbytes: int) -> _Region:
        # On AMD GPUs the buffers are uncached, so that keys and flags written over
        # XGMI are seen by the peer's next load (numba_cp.comm._hip says why).
        pointer = _hip.malloc_uncached(nbytes) if TARGET.name == "hip" else \
            self.runtime.malloc(nbytes)
        try:
            self.runtime.memset(pointer, 0, nbytes)
            self.runtime.deviceSynchronize()  # zeroed before any peer can see it
        except BaseException:
            self.runtime.free(pointer)
            raise
        return _Region(self, pointer, nbytes, owned=True)

    def handle(self, region: _Region) -> bytes:
        return bytes(self.runtime.ipcGetMemHandle(region.pointer))

    def open(self, handle: bytes, nbytes: int) -> _Region:
        pointer = self.runtime.ipcOpenMemHandle(
            bytes(handle), self.runtime.cudaIpcMemLazyEnablePeerAccess)
        return _Region(self, pointer, nbytes, owned=False)

    def view(self, region, offset, shape, strides, dtype):
        return device_view(region.pointer + offset, shape, dtype, strides)

    def published(self, region: _Region):
        """Every peer has opened ``region`` (nothing to do for CUDA IPC)."""

    def release(self, region: _Region):
        if region.pointer:
            pointer, region.pointer = region.pointer, 0
            if region.owned:
                self.runtime.free(pointer)
            else:
                self.runtime.ipcCloseMemHandle(pointer)

    def private_zeros(self, count: int, dtype):
        """A zeroed device array only this rank uses (the control words)."""
        return cuda.to_device(np.zeros(count, dtype))

    def mapped_zeros(self, count: int, dtype):
        """Zeroed host memory the device writes and the host reads with no sync."""
        words = cuda.mapped_array(count, dtype)
        words[:] = 0
        return words

    def synchronize(self):
        self.runtime.deviceSynchronize()


# Files created but not yet unlinked: removed at exit too, so that a rank that
# fails during setup (before its peers opened the file) leaves nothing in /dev/shm.
_UNPUBLISHED: set = set()


@atexit.register
def _remove_unpublished():
    for path in list(_UNPUBLISHED):
        try:
            os.unlink(path)
        except OSError:
            pass
    _UNPUBLISHED.clear()


class HostIPCMemory:
    """The simulator's stand-in for IPC: a file in ``/dev/shm`` that every rank maps.

    The handle is the file's path; the creator unlinks it once every peer has
    mapped it (:meth:`published`), so nothing is left behind if a rank dies.
    The simulator's "device arrays" are NumPy arrays, here over the mapping.
    """

    kind = "host-shm"

    def __init__(self):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.directory = base

    def allocate(self, nbytes: int) -> _Region:
        path = os.path.join(self.directory,
                            f"numba_cp_ipc_{os.getpid()}_{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # reads back as zeros
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        _UNPUBLISHED.add(path)
        array = np.frombuffer(mapping, dtype=np.uint8)
        region = _Region(self, array.__array_interface__["data"][0], nbytes, owned=True,
                         keep=[mapping, array, path])
        return region

    def handle(self, region: _Region) -> bytes:
        return region.keep[2].encode()

    def open(self, handle: bytes, nbytes: int) -> _Region:
        path = bytes(handle).decode()
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        array = np.frombuffer(mapping, dtype=np.uint8)
        return _Region(self, array.__array_interface__["data"][0], nbytes, owned=False,
                       keep=[mapping, array, None])

    def view(self, region, offset, shape, strides, dtype):
        host = np.ndarray(shape, dtype, buffer=region.keep[1], offset=offset, strides=strides)
        view = simulated_device_view(host)
        region._views.append(view)
        return view

    def published(self, region: _Region):
        path = region.keep[2]
        if region.owned and path is not None:
            region.keep[2] = None
            _UNPUBLISHED.discard(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def release(self, region: _Region):
        if region.keep is None:
            return
        self.published(region)
        mapping = region.keep[0]
        region._views.clear()
        region.keep = None
        region.pointer = 0
        try:
            mapping.close()
        except BufferError:
            pass  # a view is still referenced somewhere: the mapping goes with it

    def private_zeros(self, count: int, dtype):
        return cuda.to_device(np.zeros(count, dtype))

    mapped_zeros = private_zeros  # simulated device memory is host memory

    def synchronize(self):
        pass  # simulated kernels have finished when their launch returns


def ipc_memory():
    """The shared-memory backend for this process: CUDA/HIP IPC, or host shm under the simulator."""
    return HostIPCMemory() if TARGET.simulator else CudaIPCMemory()


# ---------------------------------------------------------------------------
# Probes (local; numba_cp.transport combines them over the communicator)

_IPC_FUNCTIONS = ("ipcGetMemHandle", "ipcOpenMemHandle", "ipcCloseMemHandle", "malloc", "free")


def local_probe(target_name: str | None = None, *, compile_only: bool | None = None
                ) -> tuple[bool, str]:
    """Whether this process can share device memory by IPC: ``(answer, reason)``.

    ``target_name`` and ``compile_only`` default to the active target's.
    """
    target_name = TARGET.name if target_name is None else target_name
    compile_only = COMPILE_ONLY if compile_only is None else compile_only
    if target_name == "sim":
        return False, ("the simulator has no device memory to share (forcing ipc emulates "
                       "it with host shared memory)")
    if compile_only:
        return False, "NUMBA_CP_COMPILE_ONLY=1: no device"
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy built for another toolkit
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    runtime = getattr(getattr(cupy, "cuda", None), "runtime", None)
    missing = [name for name in _IPC_FUNCTIONS if not hasattr(runtime, name)]
    if missing:
        return False, f"cupy.cuda.runtime lacks {', '.join(missing)}"
    return True, f"CuPy {cupy.__version__} {target_name.upper()} IPC"


def gpu_identity() -> str | None:
    """The PCI bus id of the current GPU (what peers compare), or None if unknown."""
    try:
        import cupy

        runtime = cupy.cuda.runtime
        return str(runtime.deviceGetPCIBusId(runtime.getDevice())).lower()
    except Exception:
        return None


def peer_access(identities) -> tuple[bool, str]:
    """Whether this process's GPU can map every GPU in ``identities`` (PCI bus ids)."""
    mine = gpu_identity()
    if mine is None or any(other is None for other in identities):
        return False, "the GPUs' PCI bus ids are unknown, so peer access cannot be checked"
    import cupy

    runtime = cupy.cuda.runtime
    device = runtime.getDevice()
    for other in sorted(set(identities) - {mine}):
        try:
            peer = runtime.deviceGetByPCIBusId(other)
        except Exception:
            return False, (f"GPU {other} is not visible to this process (each rank sees "
                           "only its own GPU?); force ipc to try anyway")
        if not runtime.deviceCanAccessPeer(device, peer):
            return False, f"GPU {mine} cannot access peer GPU {other}"
    count = len(set(identities))
    return True, "one shared GPU" if count == 1 else f"{count} GPUs with peer access"


# ---------------------------------------------------------------------------
# Launching


class IPCEngine:
    """One rank's side of the protocol over already shared exchange buffers.

    Args:
        rank, world: this rank and the number of ranks.
        layout: the :class:`IPCLayout` every buffer follows.
        regions: ``world`` regions: ``regions[q]`` is rank ``q``'s exchange
            buffer as mapped in this process (``regions[rank]`` its own).
        ctrl: this rank's private int64 control words (``CTRL_WORDS``, zeroed).
        errors: this rank's int64 error words (``ERROR_WORDS``, zeroed), in
            memory the host reads without a synchronisation.
        timeout: seconds a wait polls before it gives up.
        wait_in_merge: whether the fused exchange's merge blocks wait for the
            peers (each rank on a GPU of its own), or one wait kernel does
            before the merge (ranks sharing a GPU; see :mod:`numba_cp.kernels.ipc`).
    """

    def __init__(self, rank, world, layout, regions, ctrl, errors, *,
                 timeout=DEFAULT_TIMEOUT_S, wait_in_merge=True):
        if len(regions) != world:
            raise ValueError(f"{len(regions)} regions for {world} ranks")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.rank, self.world, self.layout = int(rank), int(world), layout
        self.ctrl = ctrl
        self.errors = errors
        self.timeout = float(timeout)
        self.timeout_ns = int(self.timeout * 1e9)
        L = layout
        self.flags = [r.view(0, L.flag_words, np.int64) for r in regions]
        self.data = {unit: [r.view(L.flag_bytes, L.data_bytes // unit, f"u{unit}")
                            for r in regions] for unit in (1, 8)}
        self.own_flags = self.flags[self.rank]
        self._views = {}
        # The fused exchange addresses every buffer as one run of int64 words.
        self.words = [r.view(0, L.total_bytes // 8, np.int64) for r in regions]
        self._own_region = regions[self.rank]
        self.wait_in_merge = bool(wait_in_merge)
        errors = self.errors
        if isinstance(errors, np.ndarray):  # mapped host memory: its device alias
            errors = device_view(errors.device_ctypes_pointer.value, errors.size, errors.dtype)
        self._device_errors = errors
        self._wait = KernelLaunch(K.ipc_wait_kernel, (1,), 32, [self.world, self.timeout_ns])
        self._wait_objects = tuple(map(fixed_view, (ctrl, self.own_flags, errors)))
        self._wait_pointers = _pointers(self._wait_objects)
        # The separate gather's launches. Everything but send and recv is one of these
        # buffers, so a launch is built once per payload size and a call only reads the
        # two pointers (see _separate_launches).
        self._ctrl_view, self._flag_view, self._errors_view = self._wait_objects
        self._ctrl_pointer = None if TARGET.simulator else self._wait_pointers[0]
        self._bump = KernelLaunch(K.ipc_bump_kernel, (1,), 1, [])
        self._bump_objects = (self._ctrl_view,)
        self._bump_pointers = _pointers(self._bump_objects)
        self._data_views = {unit: [fixed_view(d) for d in data] for unit, data in self.data.items()}
        self._peer_flag_views = [fixed_view(f) for f in self.flags]
        self._separate = {}

    # -- per-call pieces ------------------------------------------------------

    @staticmethod
    def unit_for(nbytes: int, *pointers: int) -> int:
        """8-byte words when the payload and both buffers allow, else bytes."""
        return 8 if nbytes % 8 == 0 and all(p % 8 == 0 for p in pointers) else 1

    def flat(self, array, pointer: int, nbytes: int, unit: int):
        """``array``'s ``nbytes`` as a 1-D kernel array of ``unit``-byte words (cached).

        On a GPU the view is made from ``pointer`` alone; ``array`` is read only
        under the simulator.
        """
        key = (pointer, nbytes, unit)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEW_CACHE:
                self._views.clear()
            if TARGET.simulator:
                host = np.asarray(array).reshape(-1).view(np.uint8)[:nbytes].view(f"u{unit}")
                view = simulated_device_view(host)
            else:
                view = device_view(pointer, nbytes // unit, f"u{unit}")
            self._views[key] = view
        return view

    # -- the three steps ----------------------------------------------------

    def _separate_launches(self, nbytes, unit) -> "_SeparateLaunches":
        """The push and wait-copy launches of ``nbytes`` payloads in ``unit``-byte words.

        Built on first use and kept: every argument but ``send`` and ``recv`` is a
        fixed buffer, and their shapes follow from ``nbytes`` and ``unit``. The
        timeout is a scalar of the wait, so it is in the key too.
        """
        key = (nbytes, unit, self.timeout_ns)
        launches = self._separate.get(key)
        if launches is None:
            if len(self._separate) >= VIEW_CACHE:
                self._separate.clear()
            launches = self._separate[key] = self._plan_separate(nbytes, unit)
        return launches

    def _plan_separate(self, nbytes, unit):
        count = nbytes // unit
        slot = self.layout.slot_bytes // unit
        threads = TARGET.ipc_threads
        blocks = max(1, min(TARGET.ipc_push_blocks, -(-count // threads)))
        data = self._data_views[unit]
        pushes = []
        for first in range(0, self.world, K.GROUP):
            # Unused peer slots repeat the first peer's buffers; the kernel skips them.
            peers = list(range(first, min(first + K.GROUP, self.world)))
            slots = peers + peers[:1] * (K.GROUP - len(peers))
            arrays = (*(data[q] for q in slots), *(self._peer_flag_views[q] for q in slots))
            launch = KernelLaunch(K.ipc_push_kernel, (blocks, len(peers)), threads,
                                  [count, slot, self.world, self.rank, len(peers)])
            pushes.append((launch, arrays, _pointers(arrays)))
        copy_blocks = max(1, min(TARGET.ipc_copy_blocks, -(-(self.world * count) // threads)))
        wait_copy = KernelLaunch(K.ipc_wait_copy_kernel, (copy_blocks,), threads,
                                 [count, slot, self.world, self.timeout_ns])
        own_data = data[self.rank]
        return _SeparateLaunches(tuple(pushes), wait_copy, own_data,
                                 None if TARGET.simulator else own_data.signature[1])

    def bump(self, stream):
        self._bump(self._bump_objects, stream, self._bump_pointers)

    def push(self, send, nbytes, unit, stream, pointer=None):
        """``send``: a flat ``unit`` kernel array of this call's ``nbytes`` payload
        (``pointer``: its address, if the caller knows it)."""
        ctrl = self._ctrl_view
        head = None
        if self._ctrl_pointer is not None:
            head = (self._ctrl_pointer, _data_pointer(send) if pointer is None else pointer)
        for launch, peers, peer_pointers in self._separate_launches(nbytes, unit).pushes:
            launch((ctrl, send, *peers), stream, None if head is None else head + peer_pointers)

    def wait_copy(self, recv, nbytes, unit, stream, pointer=None):
        """``recv``: a flat ``unit`` kernel array of ``world`` payloads of ``nbytes``
        (``pointer``: its address, if the caller knows it)."""
        launches = self._separate_launches(nbytes, unit)
        objects = (self._ctrl_view, self._flag_view, launches.own_data, recv, self._errors_view)
        pointers = None
        if self._ctrl_pointer is not None:
            pointers = (self._ctrl_pointer, self._wait_pointers[1], launches.own_data_pointer,
                        _data_pointer(recv) if pointer is None else pointer,
                        self._wait_pointers[2])
        launches.wait_copy(objects, stream, pointers)

    def all_gather(self, send, recv, nbytes, unit, stream, pointers=(None, None)):
        """Queue one gather of ``nbytes`` per rank (at most the layout's); ``pointers``:
        the addresses of ``send`` and ``recv``, if the caller knows them."""
        if nbytes == 0:
            return
        self.bump(stream)
        self.push(send, nbytes, unit, stream, pointers[0])
        self.wait_copy(recv, nbytes, unit, stream, pointers[1])

    # -- the fused exchange's arguments --------------------------------------

    def delivery(self) -> "Delivery":
        """What the delivering pack and the delivered merge take (see :class:`Delivery`)."""
        L = self.layout
        return Delivery(ctrl=fixed_view(self.ctrl), peers=tuple(map(fixed_view, self.words)),
                        data_start=L.flag_bytes // 8, slot=L.slot_bytes // 8,
                        flags=fixed_view(self.own_flags), errors=fixed_view(self._device_errors),
                        timeout_ns=self.timeout_ns,
                        keys_view=lambda shape, owned: fixed_view(
                            self.delivered_keys(shape)[:, owned]),
                        wait_in_merge=self.wait_in_merge, wait=self.wait)

    def wait(self, stream=None):
        """Queue the one-block wait for this call's deliveries (when merges do not wait)."""
        self._wait(self._wait_objects, stream, self._wait_pointers)

    def delivered_keys(self, shape):
        """int64 ``[2 * world, *shape]`` over both halves of this rank's slots: rank
        ``q``'s keys of a call of epoch ``e`` are ``[(e & 1) * world + q]``, in the
        send layout (``shape`` C-ordered from the slot's start)."""
        L = self.layout
        inner = [8]
        for n in reversed(shape[1:]):
            inner.insert(0, inner[0] * n)
        if int(np.prod(shape)) * 8 > L.slot_bytes:
            raise ValueError(f"keys of shape {tuple(shape)} do not fit a {L.slot_bytes}-byte slot")
        return self._own_region.strided_view(L.flag_bytes, (2 * self.world, *shape),
                                             (L.slot_bytes, *inner), np.int64)

    # -- host-side inspection (synchronises) ------------------------------------

    def state(self) -> dict:
        """The control words and the poison word, read back to the host."""
        ctrl = self.ctrl.copy_to_host()
        flags = self.own_flags.copy_to_host()
        return dict(epoch=int(ctrl[K.EPOCH]), error_epoch=int(ctrl[K.ERR_EPOCH]),
                    error_peer=int(ctrl[K.ERR_PEER]) - 1, poisoned_by=int(flags[-1]) - 1,
                    flags=[int(x) for x in flags[:-1]])


class _SeparateLaunches(NamedTuple):
    """One payload size's launches of the separate gather (:meth:`IPCEngine.push`,
    :meth:`IPCEngine.wait_copy`): per push launch, ``(launch, its peer buffers, their
    pointers)``; the wait-copy launch; this rank's data area it copies from."""

    pushes: tuple
    wait_copy: KernelLaunch
    own_data: object
    own_data_pointer: int | None


def _pointers(views):
    """The data pointers of fixed views; None under the simulator (no direct launch)."""
    return None if TARGET.simulator else tuple(view.signature[1] for view in views)


def _data_pointer(array) -> int:
    return array.__cuda_array_interface__["data"][0]


class Delivery(NamedTuple):
    """One rank's arguments of the fused exchange's kernels (:mod:`numba_cp.ops`).

    ``peers[q]``: rank ``q``'s exchange buffer as int64 words (flags, then the
    data halves from word ``data_start``, ``world`` slots of ``slot`` words
    each); ``ctrl``, ``flags``, ``errors``: this rank's control words, its
    own flags and its host-mapped error words; ``keys_view(shape, owned)``:
    the merge's view of both halves (:meth:`IPCEngine.delivered_keys`), heads
    ``owned`` (a slice);
    ``wait_in_merge``: whether the merge's blocks wait, or ``wait(stream)``
    is queued before a merge that does not.
    """

    ctrl: object
    peers: tuple
    data_start: int
    slot: int
    flags: object
    errors: object
    timeout_ns: int
    keys_view: Callable
    wait_in_merge: bool
    wait: Callable


def wait_setting() -> str:
    """``NUMBA_CP_IPC_WAIT``: ``merge``, ``kernel``, or empty (decide from the GPUs)."""
    setting = os.environ.get(WAIT_ENV, "").strip().lower()
    if setting not in ("", "merge", "kernel"):
        raise ValueError(f"{WAIT_ENV}={setting!r}: expected 'merge' (the merge's blocks wait "
                         "for the peers) or 'kernel' (one wait kernel before the merge)")
    return setting


def merge_waits(identities, setting="") -> bool:
    """Whether the fused merge's blocks wait for the peers: when every rank has a GPU of
    its own (``identities``: the ranks' PCI bus ids). Ranks that share one wait in a
    one-block kernel instead, which cannot starve the packs they wait for."""
    if setting:
        return setting == "merge"
    return None not in identities and len(set(identities)) == len(identities)


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    """Seconds a device-side wait polls: ``NUMBA_CP_IPC_TIMEOUT``, else ``default``."""
    return seconds_from_env(TIMEOUT_ENV, default)


@register_transport
class IPCAllGather(Transport):
    """Ranks of one node gather by writing straight into each other's GPU memory.

    :meth:`setup` (collective) allocates this rank's exchange buffer (flags and
    two halves of ``world`` payload slots, :class:`IPCLayout`),
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
        timeout: seconds a device-side wait polls for its peers before it gives
            up (default ``NUMBA_CP_IPC_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`).
            A wait that gives up poisons the peers and writes host-mapped error
            words: :meth:`failure` reads them without a synchronisation.

    In the fused exchange (:meth:`delivery`) the merge's blocks wait for the
    peers when every rank has a GPU of its own; ranks sharing a GPU (or
    unknown GPUs, as under the simulator) wait in one small kernel before the
    merge instead. ``NUMBA_CP_IPC_WAIT=merge|kernel`` chooses.

    Under the simulator (when forced) the buffers are host shared memory
    (:class:`HostIPCMemory`) and the same kernels run on it.
    :meth:`teardown` is collective: after every rank is done with the buffers,
    each waits for its device work, closes the peers' handles and frees its own.
    """

    name = "ipc"
    device = True
    capturable = True
    delivers = True

    def __init__(self, comm, *, timeout: float | None = None):
        super().__init__(comm)
        self.timeout = timeout_from_env() if timeout is None else float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.layout = None
        self.engine = None
        self._memory = None
        self._regions = []
        self._checked = {}  # (send, recv) signatures -> send's bytes (see _checked_pair)

    def _setup(self):
        self._checked = {}  # what passed was checked against the last setup's size and dtype
        comm = self.comm
        rank, world = comm.Get_rank(), comm.Get_size()
        self.layout = layout = IPCLayout(world, self.nbytes)
        if self.nbytes == 0:
            return  # every rank agreed on the shape: nothing ever moves
        regions = [None] * world
        self._regions = regions
        problem = handle = ctrl = errors = setting = None
        try:
            setting = wait_setting()
            self._memory = memory = ipc_memory()
            regions[rank] = memory.allocate(layout.total_bytes)
            handle = memory.handle(regions[rank])
            ctrl = memory.private_zeros(K.CTRL_WORDS, np.int64)
            errors = memory.mapped_zeros(K.ERROR_WORDS, np.int64)
            memory.synchronize()
        except Exception as exc:
            problem = describe_problem(exc)
        shared = agree(comm, "ipc setup (allocating and exporting the exchange buffers)",
                       problem=problem, payload=(handle, gpu_identity()), cleanup=self._release)
        handles, identities = zip(*shared)
        problem = None
        try:
            for peer in range(world):
                if peer != rank:  # a process cannot open its own IPC handle
                    regions[peer] = memory.open(handles[peer], layout.total_bytes)
            engine = IPCEngine(rank, world, layout, regions, ctrl, errors,
                               timeout=self.timeout,
                               wait_in_merge=merge_waits(identities, setting))
        except Exception as exc:
            problem = describe_problem(exc)
        agree(comm, "ipc setup (opening the peers' exchange buffers)", problem=problem,
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

    def _checked_pair(self, send, recv):
        """:meth:`_device_pair`, validated once per pair of array signatures.

        What it checks (dtypes, shapes, contiguity, size) follows from the
        signatures alone; only the overlap of the two depends on where they
        are, so that is checked on every call. A pair seen before returns
        ``send`` and ``recv`` in place of the views: on a GPU the engine views
        its payloads by address (:meth:`IPCEngine.flat`), and the simulator's
        arrays have no signature, so they always take :meth:`_device_pair`.
        """
        send_signature, recv_signature = array_signature(send), array_signature(recv)
        if send_signature is None or recv_signature is None:
            return self._device_pair(send, recv)
        key = send_signature[0], recv_signature[0]
        nbytes = self._checked.get(key)
        if nbytes is None:
            views, ranges = self._device_pair(send, recv)
            if len(self._checked) >= VIEW_CACHE:
                self._checked.clear()
            self._checked[key] = ranges[0][1]
            return views, ranges
        ranges = (send_signature[1], nbytes), (recv_signature[1], nbytes * self.layout.world)
        check_apart(*ranges)
        return (send, recv), ranges

    def _all_gather(self, send, recv, stream):
        (send_view, recv_view), (send_range, recv_range) = self._checked_pair(send, recv)
        nbytes = send_range[1]
        if nbytes == 0:
            return recv
        engine = self.engine
        unit = engine.unit_for(nbytes, send_range[0], recv_range[0])
        flat_send = engine.flat(send_view, send_range[0], nbytes, unit)
        flat_recv = engine.flat(recv_view, recv_range[0], recv_range[1], unit)
        engine.all_gather(flat_send, flat_recv, nbytes, unit, resolve_stream(stream),
                          (send_range[0], recv_range[0]))
        return recv

    def delivery(self) -> Delivery | None:
        """The fused exchange's arguments (None for a zero-byte payload: nothing moves)."""
        if not self.is_setup:
            raise RuntimeError(f"{self.name}: call setup(shape, dtype) first")
        return None if self.engine is None else self.engine.delivery()

    def failure(self) -> str | None:
        """Why gathers on this rank are unreliable, or None; reads host-mapped error
        words, so it costs no synchronisation (the plan asks before every call)."""
        engine = self.engine
        if engine is None:
            return None
        errors = engine.errors
        rank = self.comm.Get_rank()
        if errors[K.GAVE_UP_EPOCH]:
            return (f"ipc rank {rank}: call {int(errors[K.GAVE_UP_EPOCH])} gave up waiting "
                    f"for rank {int(errors[K.GAVE_UP_PEER]) - 1} after {self.timeout:g} s")
        if errors[K.POISONED_BY]:
            return (f"ipc rank {rank}: rank {int(errors[K.POISONED_BY]) - 1} gave up waiting "
                    "for a peer")
        return None

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
                f"{state['error_peer']} after {self.timeout:g} s; results from that "
                "call on are unreliable")
        if state["poisoned_by"] >= 0:
            raise IPCTimeoutError(
                f"ipc rank {rank}: rank {state['poisoned_by']} gave up waiting for a peer; "
                "results since are unreliable")
        return state


