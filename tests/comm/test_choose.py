"""Choosing a transport: forced names, the automatic order, and the collective IPC verdict.

The machine is described by :class:`~numba_cp.comm.Probes` objects (answers
for IPC, the GPU's identity, peer access and GPU-aware MPI) and the
communicator by :class:`FakeComm`, which answers every collective for all of
its ranks; the local probes themselves run against stand-in CuPy modules.
"""

from __future__ import annotations

import sys
import types

import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from comm_support import FakeComm  # noqa: E402
from numba_cp.backend import TARGET  # noqa: E402
from numba_cp.comm import (TRANSPORT_ENV, TRANSPORTS, DeviceMPI, HostMPI,  # noqa: E402
                           IPCAllGather, NCCLAllGather, Probes, StagedMPI, choose_transport,
                           ipc_verdict, requested_transport, takes_device_arrays)
from numba_cp.comm import GPU_AWARE_ENV  # noqa: E402
from numba_cp.comm import ipc as I  # noqa: E402

CHOICES = "host, ipc, mpi-device, nccl, staged"


def probes(ok=True, why="stand-in CuPy CUDA IPC", peer=(True, "one shared GPU"), aware=False,
           **replace):
    """A machine whose ranks all answer the IPC questions alike (FakeComm copies them)."""
    fields = dict(ipc_local=lambda: (ok, why), gpu_identity=lambda: "0000:1b:00.0",
                  peer_access=lambda identities: peer,
                  gpu_aware=lambda name: (aware, f"stand-in MPI, GPU-aware={int(aware)}"))
    fields.update(replace)
    return Probes(**fields)


def refusing(what):
    def refuse(*args, **kwargs):
        pytest.fail(f"{what} was asked")

    return refuse


SILENT = Probes(**{name: refusing(name) for name in ("ipc_local", "gpu_identity", "peer_access",
                                                     "shared_node", "host_name", "gpu_aware")})


class Silent(FakeComm):
    """A communicator that fails the test on any collective."""

    def allgather(self, value):
        raise AssertionError("a collective was made")

    def Split_type(self, kind):
        raise AssertionError("a collective was made")


# ---------------------------------------------------------------------------
# Forcing


def test_default_on_one_rank(monkeypatch):
    comm = MPI.COMM_SELF
    assert type(choose_transport(comm, device=False)) is HostMPI
    monkeypatch.setenv(GPU_AWARE_ENV, "0")
    chosen = choose_transport(comm, device=True)
    assert type(chosen) is StagedMPI and GPU_AWARE_ENV in chosen.reason
    monkeypatch.setenv(GPU_AWARE_ENV, "1")
    assert type(choose_transport(comm, device=True)) is DeviceMPI
    if TARGET.simulator:
        monkeypatch.delenv(GPU_AWARE_ENV)
        assert type(choose_transport(comm, device=True)) is StagedMPI


def test_gpu_aware_probe_decides_between_mpi_transports():
    chosen = choose_transport(FakeComm(1), device=True, probes=probes(aware=True))
    assert type(chosen) is DeviceMPI
    assert chosen.reason == "GPU-aware MPI: stand-in MPI, GPU-aware=1"
    chosen = choose_transport(FakeComm(1), device=True, probes=probes(aware=False))
    assert type(chosen) is StagedMPI
    assert chosen.reason == "MPI not GPU-aware: stand-in MPI, GPU-aware=0"


@pytest.mark.parametrize("name, device, cls", [
    ("host", False, HostMPI), ("mpi-device", True, DeviceMPI), ("staged", True, StagedMPI)])
def test_forced(monkeypatch, name, device, cls):
    comm = MPI.COMM_SELF
    assert type(choose_transport(comm, device=device, force=name)) is cls
    assert type(choose_transport(comm, device=device, force=name.upper())) is cls
    monkeypatch.setenv(TRANSPORT_ENV, name)
    chosen = choose_transport(comm, device=device)
    assert type(chosen) is cls and chosen.name == name and TRANSPORT_ENV in chosen.reason
    with pytest.raises(ValueError, match="device="):
        choose_transport(comm, device=not device)


def test_force_beats_env(monkeypatch):
    monkeypatch.setenv(TRANSPORT_ENV, "mpi-device")
    assert type(choose_transport(MPI.COMM_SELF, device=True, force="staged")) is StagedMPI
    assert requested_transport("staged") == ("staged", "force")
    assert requested_transport() == ("mpi-device", TRANSPORT_ENV)
    monkeypatch.setenv(TRANSPORT_ENV, "  ")
    assert requested_transport() == (None, "")


def test_unknown_lists_choices(monkeypatch):
    assert ", ".join(sorted(TRANSPORTS)) == CHOICES
    with pytest.raises(ValueError, match=f"'rdma'.*{CHOICES}"):
        choose_transport(MPI.COMM_SELF, device=True, force="rdma")
    monkeypatch.setenv(TRANSPORT_ENV, "bogus")
    with pytest.raises(ValueError, match=f"{TRANSPORT_ENV}='bogus'.*{CHOICES}"):
        choose_transport(MPI.COMM_SELF, device=True)
    assert takes_device_arrays() is None


def test_forcing_skips_the_probes(monkeypatch):
    for name, cls in (("ipc", IPCAllGather), ("nccl", NCCLAllGather), ("staged", StagedMPI)):
        assert type(choose_transport(Silent(2), device=True, force=name, probes=SILENT)) is cls
        monkeypatch.setenv(TRANSPORT_ENV, name)
        chosen = choose_transport(Silent(2), device=True, probes=SILENT)
        assert type(chosen) is cls and chosen.reason == f"forced by {TRANSPORT_ENV}={name}"
        monkeypatch.delenv(TRANSPORT_ENV)
    with pytest.raises(ValueError, match="takes device arrays"):
        choose_transport(Silent(2), device=False, force="ipc", probes=SILENT)
    assert takes_device_arrays("ipc") is True and takes_device_arrays("nccl") is True
    assert takes_device_arrays("host") is False and takes_device_arrays("rdma") is None


def test_host_arrays_ask_nobody():
    chosen = choose_transport(Silent(4), device=False, probes=SILENT)
    assert type(chosen) is HostMPI and chosen.reason == "host arrays"


# ---------------------------------------------------------------------------
# The automatic, collective choice


def test_ipc_on_one_node():
    for rank in range(4):
        chosen = choose_transport(FakeComm(4, rank), device=True, probes=probes())
        assert type(chosen) is IPCAllGather and chosen.capturable
        assert chosen.reason.startswith("IPC: all 4 ranks on node ")
        assert "one shared GPU" in chosen.reason


def test_ipc_beats_gpu_aware_mpi():
    assert type(choose_transport(FakeComm(2), device=True, probes=probes(aware=True))) \
        is IPCAllGather


def test_two_nodes():
    chosen = choose_transport(FakeComm(4, shared=False), device=True, probes=probes())
    assert type(chosen) is StagedMPI
    assert "no IPC: the ranks span more than one node" in chosen.reason
    chosen = choose_transport(FakeComm(4, shared=False), device=True, probes=probes(aware=True))
    assert type(chosen) is DeviceMPI


def test_two_nodes_are_named():
    def others(call, rank, value):
        return value[:3] + (f"node{rank % 2}",) if call == 0 else value

    ok, why = ipc_verdict(FakeComm(4, 0, shared=False, others=others),
                          probes(host_name=lambda: "node0"))
    assert not ok and why == "the ranks span more than one node (node0, node1)"


def test_cupy_missing():
    chosen = choose_transport(FakeComm(2), device=True,
                              probes=probes(ok=False, why="CuPy is not importable "
                                                          "(ImportError: no cupy)"))
    assert type(chosen) is StagedMPI
    assert "no IPC: ranks 0, 1: CuPy is not importable" in chosen.reason


def test_one_rank_says_no_and_all_agree():
    """Rank 2's probe fails: every rank (seen from each) falls back, naming rank 2."""

    def others(call, rank, value):
        if call == 0 and rank == 2:
            return (False, "CuPy is not importable", None, value[3])
        return value

    for me in (0, 1, 3):
        chosen = choose_transport(FakeComm(4, me, others=others), device=True, probes=probes())
        assert type(chosen) is StagedMPI
        assert chosen.reason.endswith("no IPC: rank 2: CuPy is not importable")


def test_ranks_failing_for_different_reasons_are_each_named():
    def others(call, rank, value):
        if call == 0 and rank in (1, 3):
            return (False, f"reason {rank}", None, value[3])
        return value

    ok, why = ipc_verdict(FakeComm(4, 0, others=others), probes())
    assert not ok and why == "rank 1: reason 1; rank 3: reason 3"


def test_peer_access_missing_on_one_rank():
    def others(call, rank, value):
        return (False, "GPU 0000:2a:00.0 is not visible") if (call == 1 and rank == 1) else value

    chosen = choose_transport(FakeComm(2, 0, others=others), device=True, probes=probes())
    assert type(chosen) is StagedMPI
    assert "rank 1: GPU 0000:2a:00.0 is not visible" in chosen.reason


def test_peer_access_is_asked_with_every_ranks_gpu():
    seen = []

    def others(call, rank, value):
        return value[:2] + (f"0000:{rank}a:00.0",) + value[3:] if call == 0 else value

    def peer_access(identities):
        seen.append(list(identities))
        return True, "4 GPUs with peer access"

    ok, _ = ipc_verdict(FakeComm(4, 2, others=others),
                        probes(peer_access=peer_access, gpu_identity=lambda: "0000:2a:00.0"))
    assert ok and seen == [["0000:0a:00.0", "0000:1a:00.0", "0000:2a:00.0", "0000:3a:00.0"]]


def test_simulator_keeps_the_mpi_path():
    if not TARGET.simulator:
        pytest.skip("the simulator's own probe")
    ok, why = I.local_probe()
    assert not ok and "simulator" in why
    chosen = choose_transport(FakeComm(3), device=True)  # the real probes
    assert type(chosen) is StagedMPI and "no IPC: ranks 0, 1, 2: the simulator" in chosen.reason
    assert type(choose_transport(FakeComm(3), device=False)) is HostMPI


def test_single_rank_asks_nobody():
    chosen = choose_transport(Silent(1), device=True,
                              probes=probes(ipc_local=refusing("ipc_local"),
                                            shared_node=refusing("shared_node")))
    assert type(chosen) is StagedMPI and "IPC" not in chosen.reason


def test_nccl_is_never_chosen_automatically():
    for ok in (True, False):
        for aware in (True, False):
            chosen = choose_transport(FakeComm(2), device=True,
                                      probes=probes(ok=ok, aware=aware))
            assert chosen.name != "nccl"


# ---------------------------------------------------------------------------
# The local probes, against stand-in CuPy modules


def _stand_in_cupy(monkeypatch, runtime):
    cupy = types.SimpleNamespace(__version__="14.0.0",
                                 cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def _runtime(**extra):
    names = dict.fromkeys(I._IPC_FUNCTIONS, lambda *a: 0)
    names.update(extra)
    return types.SimpleNamespace(**names)


def test_local_probe_stand_in_cupy(monkeypatch):
    _stand_in_cupy(monkeypatch, _runtime())
    assert I.local_probe("cuda", compile_only=False) == (True, "CuPy 14.0.0 CUDA IPC")
    assert I.local_probe("hip", compile_only=False) == (True, "CuPy 14.0.0 HIP IPC")
    bare = _runtime()
    del bare.ipcOpenMemHandle
    _stand_in_cupy(monkeypatch, bare)
    ok, why = I.local_probe("cuda", compile_only=False)
    assert not ok and "lacks ipcOpenMemHandle" in why


def test_local_probe_cupy_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError
    ok, why = I.local_probe("cuda", compile_only=False)
    assert not ok and why.startswith("CuPy is not importable (") and "cupy" in why


def test_local_probe_compile_only(monkeypatch):
    _stand_in_cupy(monkeypatch, _runtime())
    ok, why = I.local_probe("cuda", compile_only=True)
    assert ok is False and "NUMBA_CP_COMPILE_ONLY" in why
    ok, why = I.local_probe("sim", compile_only=False)
    assert ok is False and "simulator" in why


def test_peer_access_stand_in_cupy(monkeypatch):
    buses = {"0000:1b:00.0": 0, "0000:2a:00.0": 1}

    def by_bus(bus):
        if bus not in buses:
            raise RuntimeError("cudaErrorInvalidDevice")
        return buses[bus]

    can = {(0, 1): 1}
    runtime = _runtime(getDevice=lambda: 0, deviceGetPCIBusId=lambda d: "0000:1B:00.0",
                       deviceGetByPCIBusId=by_bus,
                       deviceCanAccessPeer=lambda a, b: can.get((a, b), 0))
    _stand_in_cupy(monkeypatch, runtime)
    assert I.gpu_identity() == "0000:1b:00.0"
    assert I.peer_access(["0000:1b:00.0"] * 3) == (True, "one shared GPU")
    assert I.peer_access(["0000:1b:00.0", "0000:2a:00.0"]) == (True, "2 GPUs with peer access")
    ok, why = I.peer_access(["0000:1b:00.0", "0000:99:00.0"])
    assert not ok and "not visible" in why
    can.clear()
    ok, why = I.peer_access(["0000:1b:00.0", "0000:2a:00.0"])
    assert not ok and "cannot access peer GPU 0000:2a:00.0" in why
    assert I.peer_access(["0000:1b:00.0", None])[0] is False


def test_gpu_identity_unknown_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert I.gpu_identity() is None
    ok, why = I.peer_access(["0000:1b:00.0"])
    assert not ok and "unknown" in why
