"""The MPI transports: host arrays, GPU-aware MPI, and MPI staged through pinned memory.

:class:`HostMPI` (``"host"``)
    host NumPy arrays straight into ``comm.Allgather`` (the simulator, CPU data).
:class:`DeviceMPI` (``"mpi-device"``)
    GPU-aware (CUDA- or ROCm-aware) MPI: device buffers go straight to
    ``comm.Allgather``, after the producing stream is synchronised.
:class:`StagedMPI` (``"staged"``)
    MPI that cannot read device memory: pinned host buffers allocated once
    at setup; per call a device-to-pinned copy on the stream, a stream sync,
    ``Allgather`` between the pinned buffers and a pinned-to-device copy on
    the stream. Nothing is allocated per call.

All three block the host on MPI, so none of them can be captured in a graph.
"""

from __future__ import annotations

import numpy as np

from ..arrays import as_kernel_array, device_view, resolve_stream, synchronize
from ..backend import TARGET, cuda
from .base import Transport, mpi, register_transport, wait_for

__all__ = ["HostMPI", "DeviceMPI", "StagedMPI", "LeaderAllGather"]

_LAYOUTS = 64  # payload sizes a LeaderAllGather remembers the MPI layout of


def _allgather_bytes(comm, send, recv, name):
    byte = mpi().BYTE
    wait_for(comm, comm.Iallgather([send, byte], [recv, byte]), f"{name} all-gather")


@register_transport
class HostMPI(Transport):
    """Host NumPy arrays straight into ``comm.Allgather``."""

    name = "host"
    device = False

    def _all_gather(self, send, recv, stream):
        self._host_pair(send, recv)
        _allgather_bytes(self.comm, send, recv, self.name)
        return recv


@register_transport
class DeviceMPI(Transport):
    """GPU-aware MPI: device buffers straight into ``comm.Allgather``.

    The stream is synchronised first, so ``send`` is complete when MPI reads
    it; ``recv`` is complete when the call returns. Under the simulator the
    simulated device arrays are host memory, which MPI reads directly.
    """

    name = "mpi-device"
    device = True

    @staticmethod
    def _buffer(view, byte_range):
        if TARGET.simulator:
            return np.asarray(view)  # the simulated device array's own memory, not a copy
        return device_view(*byte_range, np.uint8)

    def _all_gather(self, send, recv, stream):
        (send_view, recv_view), (send_range, recv_range) = self._device_pair(send, recv)
        synchronize(resolve_stream(stream))
        _allgather_bytes(self.comm, self._buffer(send_view, send_range),
                         self._buffer(recv_view, recv_range), self.name)
        return recv


@register_transport
class StagedMPI(Transport):
    """MPI that cannot read device memory: through pinned host buffers made at setup.

    Per call: ``send`` -> pinned copy on the stream, stream sync,
    ``Allgather`` between pinned buffers, pinned -> ``recv`` copy on the
    stream (not waited for: later work on the same stream sees ``recv``). An
    event recorded after that copy keeps the next call from overwriting the
    pinned buffer while the copy may still read it.
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
        self._send_host = allocate(self.nbytes, dtype=np.uint8)
        self._recv_host = allocate(self.nbytes * self.comm.Get_size(), dtype=np.uint8)
        self._copied = cuda.event() if TARGET.simulator else cuda.event(timing=False)
        self._pending = False

    def _teardown(self):
        if self._pending:
            self._copied.synchronize()
        self._send_host = self._recv_host = self._copied = None
        self._pending = False

    def _all_gather(self, send, recv, stream):
        (send_view, recv_view), ((_, nbytes), _) = self._device_pair(send, recv)
        world = self.comm.Get_size()
        stream = resolve_stream(stream)
        send_host = self._send_host[:nbytes].view(self.dtype).reshape(send_view.shape)
        recv_host = self._recv_host[:world * nbytes].view(self.dtype).reshape(recv_view.shape)
        if nbytes:
            send_view.copy_to_host(send_host, stream=stream)
        synchronize(stream)
        if self._pending:  # the last call's pinned -> device copy, maybe on another stream
            self._copied.synchronize()
            self._pending = False
        _allgather_bytes(self.comm, send_host, recv_host, self.name)
        if nbytes:
            recv_view.copy_to_device(recv_host, stream=stream)
            self._copied.record(stream)
            self._pending = True
        return recv


class LeaderAllGather:
    """Every group's payload, from its leader, to every rank: the second level of a
    two-level exchange (one payload per node instead of one per rank).

    One ``Iallgatherv`` on the whole communicator in which only the leaders
    send (so groups of any sizes work, and a rank waits at most the collective
    timeout); on a GPU through pinned host buffers allocated once, as
    :class:`StagedMPI` does; host arrays (``device=False``) go to MPI as they are.
    Not capturable: it blocks the host on MPI.

    Args:
        comm: the whole communicator.
        leaders: the world rank of each group's leader, in group order.
        nbytes: the most bytes one leader sends.
        device: whether ``send`` and ``recv`` are device arrays.
    """

    name = "leaders-mpi"

    def __init__(self, comm, leaders, nbytes: int, *, device: bool):
        self.comm = comm
        self.leaders = [int(r) for r in leaders]
        self.groups = len(self.leaders)
        self.nbytes = int(nbytes)
        self.device = bool(device)
        self.is_leader = comm.Get_rank() in self.leaders
        allocate = cuda.pinned_array if (device and not TARGET.simulator and nbytes) else np.empty
        self._send_host = allocate(self.nbytes, dtype=np.uint8)
        self._recv_host = allocate(self.nbytes * self.groups, dtype=np.uint8)
        self._layouts = {}  # nbytes -> (counts, displacements): callers repeat a few sizes

    def _layout(self, nbytes):
        """``Iallgatherv``'s counts and displacements for ``nbytes`` per leader."""
        layout = self._layouts.get(nbytes)
        if layout is None:
            counts = [0] * self.comm.Get_size()
            displacements = [0] * self.comm.Get_size()
            for group, leader in enumerate(self.leaders):
                counts[leader] = nbytes
                displacements[leader] = group * nbytes
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[nbytes] = (counts, displacements)
        return layout

    def all_gather(self, send, recv, stream=None):
        """``send`` (C-contiguous, at most ``nbytes``; read on leaders only) -> ``recv``
        (C-contiguous, ``groups`` times ``send``'s bytes, group order)."""
        nbytes = int(np.prod(send.shape, dtype=np.int64)) * np.dtype(send.dtype).itemsize
        if nbytes > self.nbytes:
            raise ValueError(f"send: {nbytes} bytes, more than the {self.nbytes} this "
                             "gather was set up for")
        staged = self.device and not TARGET.simulator
        stream = resolve_stream(stream)
        if staged:
            send_view = as_kernel_array(send, "send").arg
            recv_view = as_kernel_array(recv, "recv").arg
            send_host = self._send_host[:nbytes].view(send_view.dtype).reshape(send_view.shape)
            recv_host = self._recv_host[:self.groups * nbytes].view(recv_view.dtype).reshape(
                recv_view.shape)
            if self.is_leader and nbytes:
                send_view.copy_to_host(send_host, stream=stream)
            synchronize(stream)
            send_bytes, recv_bytes = self._send_host, self._recv_host
        else:
            send_bytes = np.asarray(send).reshape(-1).view(np.uint8)
            recv_bytes = np.asarray(recv).reshape(-1).view(np.uint8)
            synchronize(stream)
        byte = mpi().BYTE
        mine = nbytes if self.is_leader else 0
        wait_for(self.comm, self.comm.Iallgatherv(
            [send_bytes[:mine], mine, byte],
            [recv_bytes[:self.groups * nbytes], self._layout(nbytes), byte]),
            "two-level exchange: the nodes' keys")
        if staged and nbytes:
            recv_view.copy_to_device(recv_host, stream=stream)
            synchronize(stream)  # the pinned buffer is reused by the next call
        return recv
