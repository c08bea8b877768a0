"""A stand-in for ``cupy.cuda.nccl`` under the simulator (tests only).

``ncclAllGather`` becomes ``COMM.Allgather`` on the host addresses the
transport passes (the simulator's device arrays are host memory). The
communicator checks what the real NCCL needs of its callers: every rank
brings the *same* unique id, which only rank 0 generated, and the matching
size and rank. ``CALLS`` records what happened, for the tests to assert on.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

NCCL_INT8 = 0
NCCL_UINT8 = 1
NCCL_UNIQUE_ID_BYTES = 128
available = True

COMM = None  # the mpi4py communicator the fake NCCL communicator spans; set by the caller
CALLS = {"get_unique_id": 0, "init": [], "allGather": [], "destroy": 0}
_ids_since_init = 0


def reset(comm):
    global COMM, _ids_since_init
    COMM = comm
    _ids_since_init = 0
    CALLS.update(get_unique_id=0, init=[], allGather=[], destroy=0)


def get_unique_id():
    global _ids_since_init
    CALLS["get_unique_id"] += 1
    _ids_since_init += 1
    seed = (os.getpid() * 7919) & 0xFF  # differs between processes, as NCCL's does
    return tuple(((seed + 3 * i) % 256) - 128 for i in range(NCCL_UNIQUE_ID_BYTES))


def _bytes_at(address, count):
    if count == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(address))


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        global _ids_since_init
        if COMM is None:
            raise RuntimeError("fake_nccl.COMM is not set")
        commId = tuple(commId)
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique id of {len(commId)} bytes")
        if ndev != COMM.Get_size() or rank != COMM.Get_rank():
            raise ValueError(f"NcclCommunicator({ndev}, ..., {rank}) on rank "
                             f"{COMM.Get_rank()} of {COMM.Get_size()}")
        ids = COMM.allgather(commId)
        generated = COMM.allgather(_ids_since_init)
        _ids_since_init = 0
        if any(other != ids[0] for other in ids):
            raise RuntimeError("ranks brought different unique ids")
        if generated != [1] + [0] * (COMM.Get_size() - 1):
            raise RuntimeError(f"get_unique_id calls per rank: {generated} (only rank 0 "
                               "should make the id)")
        CALLS["init"].append((ndev, commId, rank))
        self._alive = True

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        if not self._alive:
            raise RuntimeError("allGather on a destroyed communicator")
        if datatype not in (NCCL_UINT8, NCCL_INT8):
            raise ValueError(f"datatype {datatype}: the transport moves bytes")
        CALLS["allGather"].append((sendbuf, recvbuf, count, datatype, stream))
        send = _bytes_at(sendbuf, count)
        recv = _bytes_at(recvbuf, count * COMM.Get_size())
        COMM.Allgather(send, recv)

    def destroy(self):
        if self._alive:
            CALLS["destroy"] += 1
        self._alive = False
