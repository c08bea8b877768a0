"""The NCCL/RCCL transport (``"nccl"``): ``ncclAllGather`` on bytes, through ``cupy.cuda.nccl``.

Opt-in only: NCCL refuses two ranks on one GPU, so it is never chosen
automatically. Capturable: each call is one ``allGather`` on the stream.
"""

from __future__ import annotations

import numpy as np

from ..arrays import byte_range, device_copy, resolve_stream, stream_handle, synchronize
from ..backend import TARGET
from .base import Transport, agree, describe_problem, register_transport

__all__ = ["NCCLAllGather", "nccl_module"]


def nccl_module():
    """``cupy.cuda.nccl`` (RCCL under cupy-rocm), or ImportError naming why not."""
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise ImportError("cupy.cuda.nccl: CuPy was built without NCCL")
    return nccl


@register_transport
class NCCLAllGather(Transport):
    """``ncclAllGather`` on bytes (RCCL on AMD).

    :meth:`setup` (collective): rank 0 makes the unique id, ``comm.bcast``
    shares it, every rank builds ``NcclCommunicator(world, uid, rank)`` on its
    current device, and one warm-up all-gather of the largest payload runs and
    is waited for: NCCL connects lazily, and connecting inside a graph capture
    hangs.

    Args:
        comm: the communicator.
        module: the ``cupy.cuda.nccl``-like module to use (default:
            :func:`nccl_module`); tests pass a stand-in.
    """

    name = "nccl"
    device = True
    capturable = True

    def __init__(self, comm, *, module=None):
        super().__init__(comm)
        self._module = module
        self._nccl = None
        self._comm = None

    def _setup(self):
        comm = self.comm
        rank, world = comm.Get_rank(), comm.Get_size()
        problem = uid = None
        try:
            nccl = self._module if self._module is not None else nccl_module()
            if rank == 0:
                uid = nccl.get_unique_id()
        except Exception as exc:
            problem = describe_problem(exc)
        # Before NCCL's own (blocking) init: a rank that cannot even start must
        # not leave the others waiting in ncclCommInitRank.
        agree(comm, "nccl setup (loading NCCL)", problem=problem)
        uid = comm.bcast(uid, root=0)
        problem = None
        try:
            self._nccl = nccl
            self._comm = nccl.NcclCommunicator(world, uid, rank)
            if self.nbytes:
                send = device_copy(np.zeros(self.nbytes, np.uint8), simulated_device=True)
                recv = device_copy(np.zeros(self.nbytes * world, np.uint8),
                                   simulated_device=True)
                stream = self._warmup_stream()
                self._comm.allGather(byte_range(send, "send")[0], byte_range(recv, "recv")[0],
                                     self.nbytes,
                                     nccl.NCCL_UINT8, stream_handle(stream))
                synchronize(resolve_stream(stream))
                del send, recv
        except Exception as exc:
            problem = describe_problem(exc)
        agree(comm, "nccl setup (communicator and warm-up)", problem=problem,
              cleanup=self._destroy)

    @staticmethod
    def _warmup_stream():
        if TARGET.simulator:
            return 0
        import cupy

        return cupy.cuda.Stream(non_blocking=True)

    def _destroy(self):
        nccl_comm, self._comm = self._comm, None
        if nccl_comm is not None:
            nccl_comm.destroy()

    def _teardown(self):
        self._destroy()
        self._nccl = None

    def _all_gather(self, send, recv, stream):
        _, ((send_address, nbytes), (recv_address, _)) = self._device_pair(send, recv)
        if nbytes:
            self._comm.allGather(send_address, recv_address, nbytes, self._nccl.NCCL_UINT8,
                                 stream_handle(stream))
        return recv
