"""All-gather transports over an mpi4py communicator, one way of moving bytes per module.

=============  ==============================  =========================================
name           class                           moves bytes by
=============  ==============================  =========================================
``host``       :class:`HostMPI`                ``MPI_Allgather`` on host NumPy arrays
``mpi-device`` :class:`DeviceMPI`              GPU-aware MPI on device buffers
``staged``     :class:`StagedMPI`              MPI through pinned host buffers
``ipc``        :class:`IPCAllGather`           kernels writing into peers' mapped memory
``nccl``       :class:`NCCLAllGather`          ``ncclAllGather`` / RCCL (opt-in)
=============  ==============================  =========================================

:mod:`.base` holds the interface and the rank-agreement helper,
:mod:`.gpu_aware` asks the MPI library whether it reads GPU memory, and
:mod:`.choose` picks one transport, the same on every rank.
"""

from .base import (TIMEOUT_ENV, TRANSPORTS, Transport, agree, barrier, collective_timeout,
                   describe_problem, register_transport)
from .choose import (TRANSPORT_ENV, Probes, checked_request, choose_transport, ipc_verdict,
                     requested_transport, takes_device_arrays)
from .gpu_aware import GPU_AWARE_ENV, gpu_aware_mpi
from .ipc import IPCAllGather
from .mpi import DeviceMPI, HostMPI, LeaderAllGather, StagedMPI
from .nccl import NCCLAllGather

__all__ = ["Transport", "HostMPI", "DeviceMPI", "StagedMPI", "IPCAllGather", "NCCLAllGather",
           "LeaderAllGather",
           "TRANSPORTS", "register_transport", "agree", "barrier", "describe_problem",
           "collective_timeout", "choose_transport", "checked_request", "Probes",
           "ipc_verdict", "requested_transport", "takes_device_arrays", "gpu_aware_mpi",
           "GPU_AWARE_ENV", "TRANSPORT_ENV", "TIMEOUT_ENV"]
