"""The one place that picks a transport, the same on every rank.

``device=True``: :class:`~numba_cp.comm.ipc.IPCAllGather` when every rank of
the communicator is on one node and can map every rank's GPU memory
(:func:`ipc_verdict`, collective); else
:class:`~numba_cp.comm.mpi.DeviceMPI` when the MPI library reads GPU memory
(:func:`~numba_cp.comm.gpu_aware.gpu_aware_mpi`); else
:class:`~numba_cp.comm.mpi.StagedMPI`. ``device=False`` (host arrays):
:class:`~numba_cp.comm.mpi.HostMPI`. NCCL only when forced, since it refuses
two ranks on one GPU. ``NUMBA_CP_TRANSPORT=<name>`` (or ``force=``) names one.

Every question the choice asks of the machine is a field of :class:`Probes`,
so a test hands in answers instead of patching modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ..backend import TARGET
from . import ipc
from .base import TRANSPORTS, Transport, allgather_objects, mpi
from .gpu_aware import gpu_aware_mpi
from .mpi import DeviceMPI, HostMPI, StagedMPI

__all__ = ["Probes", "choose_transport", "ipc_verdict", "requested_transport",
           "checked_request", "takes_device_arrays", "TRANSPORT_ENV"]

TRANSPORT_ENV = "NUMBA_CP_TRANSPORT"


def _shared_node(comm) -> bool:
    """Whether every rank of ``comm`` is in one shared-memory domain (collective)."""
    MPI = mpi()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size() == comm.Get_size()
    finally:
        local.Free()


def _processor_name() -> str:
    return mpi().Get_processor_name()


@dataclass(frozen=True)
class Probes:
    """What the choice asks of this process and its communicator.

    ``ipc_local() -> (ok, why)``: this process can share GPU memory by IPC.
    ``gpu_identity() -> str | None``: the PCI bus id of its GPU.
    ``peer_access(identities) -> (ok, why)``: its GPU can map all of them.
    ``shared_node(comm) -> bool``: every rank is on one node (collective).
    ``host_name() -> str``: this node's name, for messages.
    ``gpu_aware(target_name) -> (ok, why)``: the MPI library reads GPU memory.
    """

    ipc_local: Callable = ipc.local_probe
    gpu_identity: Callable = ipc.gpu_identity
    peer_access: Callable = ipc.peer_access
    shared_node: Callable = _shared_node
    host_name: Callable = _processor_name
    gpu_aware: Callable = gpu_aware_mpi


def requested_transport(force: str | None = None) -> tuple[str | None, str]:
    """The transport asked for, and by whom: ``force``, else ``NUMBA_CP_TRANSPORT``."""
    if force is not None:
        return force, "force"
    env = os.environ.get(TRANSPORT_ENV, "").strip()
    return (env, TRANSPORT_ENV) if env else (None, "")


def checked_request(force: str | None, device: bool) -> str | None:
    """The transport name asked for (``force`` or ``NUMBA_CP_TRANSPORT``), checked:
    None when none is, ValueError when it is unknown or takes the other kind of array."""
    force, source = requested_transport(force)
    if force is None:
        return None
    cls = TRANSPORTS.get(str(force).strip().lower())
    if cls is None:
        raise ValueError(f"{source}={force!r}: unknown transport; choose one of "
                         f"{', '.join(sorted(TRANSPORTS))}")
    if cls.device != bool(device):
        kind = "device" if cls.device else "host NumPy"
        raise ValueError(f"{source}={force!r}: the {cls.name} transport takes {kind} "
                         f"arrays but device={bool(device)} was asked for")
    return cls.name


def takes_device_arrays(force: str | None = None) -> bool | None:
    """Whether the requested transport takes device arrays; None if none (or no such) is named."""
    name, _ = requested_transport(force)
    cls = TRANSPORTS.get(str(name).strip().lower()) if name is not None else None
    return None if cls is None else cls.device


def _summarise(failures) -> str:
    """``rank r: why`` for each failing rank, or one line when they all say the same."""
    reasons = {why for _, why in failures}
    if len(reasons) == 1:
        ranks = [rank for rank, _ in failures]
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else "ranks " + ", ".join(str(r) for r in ranks))
        return f"{who}: {reasons.pop()}"
    return "; ".join(f"rank {rank}: {why}" for rank, why in failures)


def ipc_verdict(comm, probes: Probes = Probes()) -> tuple[bool, str]:
    """Whether :class:`~numba_cp.comm.ipc.IPCAllGather` can serve ``comm``: the same
    answer on every rank.

    Collective (for more than one rank): every rank must be on one node, pass
    ``probes.ipc_local`` (CuPy with the IPC functions, a real GPU target) and
    be able to map every other rank's GPU (peer access between their PCI bus
    ids). The local answers are all-gathered, so every rank decides alike.
    """
    world = comm.Get_size()
    if world < 2:
        return False, "a single rank has no peer to map"
    ok, why = probes.ipc_local()
    identity = probes.gpu_identity() if ok else None
    shared = probes.shared_node(comm)
    everyone = allgather_objects(comm, (bool(ok), str(why), identity, probes.host_name()),
                                 "choosing the transport")
    hosts = sorted({host for *_, host in everyone})
    if not shared:
        return False, f"the ranks span more than one node ({', '.join(hosts)})"
    failures = [(rank, w) for rank, (o, w, _, _) in enumerate(everyone) if not o]
    if failures:
        return False, _summarise(failures)
    reachable, how = probes.peer_access([identity for _, _, identity, _ in everyone])
    verdicts = allgather_objects(comm, (bool(reachable), str(how)), "choosing the transport")
    failures = [(rank, w) for rank, (o, w) in enumerate(verdicts) if not o]
    if failures:
        return False, _summarise(failures)
    return True, (f"all {world} ranks on node {hosts[0]} map each other's GPU memory "
                  f"({verdicts[0][1]}; {everyone[0][1]})")


def choose_transport(comm, *, device: bool, force: str | None = None,
                     probes: Probes = Probes()) -> Transport:
    """The transport for ``comm``, not set up yet (call ``setup`` on every rank).

    ``force`` (or ``NUMBA_CP_TRANSPORT`` when ``force`` is None) names a
    transport from :data:`~numba_cp.comm.TRANSPORTS`; it must take the kind
    of array ``device`` says. Otherwise the order in the module docstring
    decides; with ``device=True`` and more than one rank that is collective.
    """
    name = checked_request(force, device)
    if name is not None:
        force, source = requested_transport(force)
        transport = TRANSPORTS[name](comm)
        transport.reason = f"forced by {source}={force}"
        return transport
    if not device:
        transport = HostMPI(comm)
        transport.reason = "host arrays"
        return transport
    ipc_ok, ipc_why = ipc_verdict(comm, probes)
    if ipc_ok:
        transport = ipc.IPCAllGather(comm)
        transport.reason = f"IPC: {ipc_why}"
        return transport
    aware, why = probes.gpu_aware(TARGET.name)
    transport = DeviceMPI(comm) if aware else StagedMPI(comm)
    transport.reason = ("GPU-aware MPI: " if aware else "MPI not GPU-aware: ") + why
    if comm.Get_size() > 1:
        transport.reason += f"; no IPC: {ipc_why}"
    return transport
