"""The device-side all-gather transports (IPC, NCCL) and the transport choice, on a CPU.

- a pure-Python model of the IPC protocol, driven through many random
  interleavings at the granularity of single slot writes, flag stores and
  slot reads, with the halves addressed by the kernels' own ``slot_base``;
  the same model without double buffering, or waiting for ``flag == epoch``,
  must fail (so the model can see the races the design avoids);
- the real IPC kernels under the simulator with several ranks in one
  process, stepped kernel by kernel: a rank running a call ahead, timeouts
  and poison, more peers than one push launch serves, the byte-wise path;
- the automatic choice (same node or not, CuPy missing, the simulator, one
  rank saying no) with a fake communicator and patched probes, and the local
  probes against fake CuPy modules;
- NCCL's setup (unique id from rank 0, warm-up, errors agreed) with a fake
  ``cupy.cuda.nccl``;
- under mpiexec: the IPC transport emulated on host shared memory, the
  collective automatic choice, fake NCCL, the main job with ``--transport ipc
  --graph``, and ``launch/ipc_check.py`` (the GPU check script) itself;
- the IPC kernels assembled to sm_90 SASS by nvJitLink (their inline PTX),
  when the cuda-toolkit wheels are installed.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from numba_cp import backend  # noqa: E402
from numba_cp import ipc as I  # noqa: E402
from numba_cp import transport as T  # noqa: E402
from numba_cp.backend import cuda  # noqa: E402
from numba_cp.errors import RankAgreementError  # noqa: E402
from numba_cp.kernels import ipc as K  # noqa: E402
from support import run_mpiexec  # noqa: E402

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "mpi_scripts"
sim_only = pytest.mark.skipif(not backend.is_simulator,
                              reason="drives simulated ranks in one process")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (T.TRANSPORT_ENV, T.GPU_AWARE_ENV, I.SPIN_LIMIT_ENV):
        monkeypatch.delenv(var, raising=False)
    T._probe.cache_clear()
    yield
    T._probe.cache_clear()


# ---------------------------------------------------------------------------
# The protocol as a model


def run_model(world, calls, rng, *, double_buffer=True, wait_ge=True):
    """One random interleaving of ``world`` ranks making ``calls`` all-gathers.

    Per call a rank writes its payload into every peer's slot (one step per
    peer), then stores its flag in every peer (one step each), waits until
    its own flags reach the epoch, then reads every slot (one step each), as
    the kernels do. Returns ``(corrupt reads, deadlocked, largest lead)``.
    """
    slot = ((lambda e, q: K.slot_base(e, world, q, 1)) if double_buffer else
            (lambda e, q: q))
    data = [dict() for _ in range(world)]  # owner -> slot -> (writer, epoch)
    flags = [[0] * world for _ in range(world)]  # owner -> writer -> epoch
    started = [0] * world

    def program(r):
        for e in range(1, calls + 1):
            started[r] = e
            for q in rng.sample(range(world), world):
                data[q][slot(e, r)] = (r, e)
                yield None
            for q in rng.sample(range(world), world):
                flags[q][r] = max(flags[q][r], e)
                yield None
            while not all((f >= e) if wait_ge else (f == e) for f in flags[r]):
                yield "blocked"
            for q in rng.sample(range(world), world):
                got = data[r].get(slot(e, q))
                yield ("read", got == (q, e))

    running = {r: program(r) for r in range(world)}
    blocked = set()  # ranks found waiting since the state last changed
    corrupt, lead = 0, 0
    while running:
        r = rng.choice(sorted(running))
        try:
            step = next(running[r])
        except StopIteration:
            del running[r]
            blocked.discard(r)
            continue
        if step == "blocked":
            blocked.add(r)
            if blocked >= set(running):
                return corrupt, True, lead  # all wait and nobody can change a flag
            continue
        blocked.clear()
        if step is not None and not step[1]:
            corrupt += 1
        lead = max(lead, max(started) - min(started))
    return corrupt, False, lead


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_model_double_buffered_is_exact_and_never_deadlocks(world):
    for seed in range(300 if world < 4 else 120):
        corrupt, deadlocked, lead = run_model(world, 6, random.Random(seed))
        assert (corrupt, deadlocked) == (0, False), f"seed {seed}"
        assert lead <= 1, f"seed {seed}: a rank got {lead} calls ahead"


def test_model_sees_the_race_without_double_buffering():
    """One half only: a fast rank's next payload overwrites a slot a peer has not read."""
    bad = sum(run_model(2, 6, random.Random(seed), double_buffer=False)[0] > 0
              for seed in range(200))
    assert bad > 0


def test_model_sees_the_overtaken_flag_when_waiting_for_equality():
    """``flag == epoch``: a peer already at the next call moved the flag on; hangs."""
    hung = sum(run_model(2, 6, random.Random(seed), wait_ge=False)[1] for seed in range(200))
    assert hung > 0


def test_layout():
    L = I.IPCLayout(3, 1000)
    assert L.flag_words == 4 and L.flag_bytes == 256
    assert L.slot_bytes == 1024 and L.data_bytes == 2 * 3 * 1024
    assert L.total_bytes == 256 + 6144
    # call e uses half e & 1; rank q's slot within it
    assert [L.slot_offset(e, 1) for e in (1, 2, 3)] == [4 * 1024, 1024, 4 * 1024]
    assert I.IPCLayout(2, 0).slot_bytes == 256


# ---------------------------------------------------------------------------
# The real kernels, several simulated ranks in one process


class Ranks:
    """``world`` IPCEngines over host shared memory, all in this process."""

    def __init__(self, world, shape=(2, 3, 4), dtype=np.int64, spin_limit=10_000):
        self.world, self.shape, self.dtype = world, tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self.layout = I.IPCLayout(world, self.nbytes)
        self.memory = I.HostIPCMemory()
        self.regions = [self.memory.allocate(self.layout.total_bytes) for _ in range(world)]
        self.engines = [I.IPCEngine(r, world, self.layout, self.regions,
                                    self.memory.private_zeros(K.CTRL_WORDS, np.int64),
                                    spin_limit=spin_limit) for r in range(world)]
        self.send = [cuda.to_device(np.zeros(self.shape, self.dtype)) for _ in range(world)]
        self.recv = [cuda.to_device(np.zeros((world,) + self.shape, self.dtype))
                     for _ in range(world)]
        self.unit = I.IPCEngine.unit_for(self.nbytes, 0, 0)

    def payload(self, r, e):
        n = int(np.prod(self.shape))
        raw = (np.arange(n * self.dtype.itemsize, dtype=np.int64) * 7 + 31 * r + 101 * e)
        return (raw % 251).astype(np.uint8).view(self.dtype).reshape(self.shape)

    def flat(self, r, which):
        array = (self.send if which == "send" else self.recv)[r]
        size = self.nbytes * (1 if which == "send" else self.world)
        return self.engines[r].flat(array, np.asarray(array).ctypes.data, size, self.unit)

    def bump(self, r):
        self.engines[r].bump(0)

    def push(self, r, e):
        np.asarray(self.send[r])[...] = self.payload(r, e)
        self.engines[r].push(self.flat(r, "send"), self.unit, 0)

    def ready(self, r, e):
        return all(int(f) >= e for f in np.asarray(self.engines[r].own_flags)[:self.world])

    def wait_copy(self, r):
        self.engines[r].wait_copy(self.flat(r, "recv"), self.unit, 0)

    def expected(self, e):
        return np.stack([self.payload(q, e) for q in range(self.world)])

    def got(self, r):
        return self.recv[r].copy_to_host()

    def close(self):
        for region in self.regions:
            self.memory.release(region)


@pytest.fixture
def ranks():
    made = []

    def make(*args, **kwargs):
        made.append(Ranks(*args, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


@sim_only
def test_kernels_fast_rank_runs_a_call_ahead(ranks):
    R = ranks(2)
    for r in (0, 1):
        R.bump(r)
        R.push(r, 1)
    R.wait_copy(0)
    assert np.array_equal(R.got(0), R.expected(1))
    R.bump(0)
    R.push(0, 2)  # rank 0 is in call 2; rank 1 has not copied call 1 out yet
    assert not R.ready(0, 2), "rank 0 must wait for rank 1's call 2"
    assert int(np.asarray(R.engines[1].own_flags)[0]) == 2, "rank 0's flag overtook call 1"
    R.wait_copy(1)  # >= 1 passes; call 1's payload is intact in the other half
    assert np.array_equal(R.got(1), R.expected(1))
    R.bump(1)
    R.push(1, 2)
    for r in (0, 1):
        assert R.ready(r, 2)
        R.wait_copy(r)
        assert np.array_equal(R.got(r), R.expected(2))
    assert [e.state()["epoch"] for e in R.engines] == [2, 2]


@sim_only
@pytest.mark.parametrize("world, seed", [(2, 0), (3, 1), (3, 2), (4, 3)])
def test_kernels_random_schedules(ranks, world, seed):
    """Kernel-granularity interleavings: each rank's next kernel runs when it can."""
    R = ranks(world)
    rng = random.Random(seed)
    calls = 4
    step = [0] * world  # 0 bump, 1 push, 2 wait_copy (when ready)
    call = [1] * world
    while any(c <= calls for c in call):
        runnable = [r for r in range(world) if call[r] <= calls
                    and (step[r] < 2 or R.ready(r, call[r]))]
        assert runnable, f"stuck at calls {call}, steps {step}"
        r = rng.choice(runnable)
        if step[r] == 0:
            R.bump(r)
        elif step[r] == 1:
            R.push(r, call[r])
        else:
            R.wait_copy(r)
            assert np.array_equal(R.got(r), R.expected(call[r])), (r, call[r])
            call[r] += 1
        step[r] = (step[r] + 1) % 3
        assert max(call) - min(call) <= 2
    for engine in R.engines:
        state = engine.state()
        assert state["epoch"] == calls and state["error_epoch"] == 0


@sim_only
def test_kernels_more_peers_than_one_push_launch(ranks):
    world = K.GROUP + 1  # two push launches per call
    R = ranks(world, shape=(5,), dtype=np.int64)
    for e in (1, 2):
        for r in range(world):
            R.bump(r)
            R.push(r, e)
        for r in range(world):
            assert R.ready(r, e)
            R.wait_copy(r)
            assert np.array_equal(R.got(r), R.expected(e))


@sim_only
def test_kernels_byte_payload(ranks):
    R = ranks(3, shape=(3, 7), dtype=np.uint8)  # 21 bytes: the byte-wise kernels
    assert R.unit == 1
    for r in range(3):
        R.bump(r)
        R.push(r, 1)
    for r in range(3):
        R.wait_copy(r)
        assert np.array_equal(R.got(r), R.expected(1))


@sim_only
def test_kernels_timeout_then_poison(ranks):
    R = ranks(3, spin_limit=5)
    R.bump(0)
    R.push(0, 1)
    t0 = time.perf_counter()
    R.wait_copy(0)  # nobody else came: gives up after 5 polls instead of hanging
    assert time.perf_counter() - t0 < 10
    state = R.engines[0].state()
    assert (state["error_epoch"], state["error_peer"], state["poisoned_by"]) == (1, 1, -1)
    # later waits of a rank that gave up do not wait at all, whatever the limit
    R.engines[0].spin_limit = 10**12
    R.bump(0)
    R.push(0, 2)  # poisons every peer before its payload
    t0 = time.perf_counter()
    R.wait_copy(0)
    assert time.perf_counter() - t0 < 10
    for r in (1, 2):
        assert R.engines[r].state()["poisoned_by"] == 0
    # a poisoned rank stops waiting as well (rank 2 never comes)
    R.engines[1].spin_limit = 10**12
    R.bump(1)
    R.push(1, 1)
    t0 = time.perf_counter()
    R.wait_copy(1)
    assert time.perf_counter() - t0 < 10
    assert R.engines[1].state()["error_epoch"] == 0


@sim_only
def test_transport_check_reports_timeout_and_poison(monkeypatch):
    t = T.IPCAllGather(MPI.COMM_SELF, spin_limit=3).setup((4,), np.int64)
    try:
        send = cuda.to_device(np.arange(4, dtype=np.int64))
        recv = cuda.to_device(np.zeros((1, 4), np.int64))
        t.all_gather(send, recv)
        assert t.check()["epoch"] == 1
        # simulate a timed-out wait and a peer's poison
        t.engine.ctrl[K.ERR_EPOCH] = 7
        t.engine.ctrl[K.ERR_PEER] = 3
        with pytest.raises(T.IPCTimeoutError, match="call 7 gave up waiting for rank 2"):
            t.check()
        t.engine.ctrl[K.ERR_EPOCH] = 0
        np.asarray(t.engine.own_flags)[-1] = 2
        with pytest.raises(T.IPCTimeoutError, match="rank 1 gave up"):
            t.check()
    finally:
        t.teardown()
    assert t.engine is None and not t.is_setup


def test_spin_limit_env(monkeypatch):
    assert T.IPCAllGather(MPI.COMM_SELF).spin_limit == I.SPIN_LIMIT
    monkeypatch.setenv(I.SPIN_LIMIT_ENV, "0x100")
    assert T.IPCAllGather(MPI.COMM_SELF).spin_limit == 256
    assert T.IPCAllGather(MPI.COMM_SELF, spin_limit=9).spin_limit == 9
    for bad in ("0", "many"):
        monkeypatch.setenv(I.SPIN_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match=I.SPIN_LIMIT_ENV):
            T.IPCAllGather(MPI.COMM_SELF)


@sim_only
def test_ipc_allocates_only_at_setup(monkeypatch):
    t = T.IPCAllGather(MPI.COMM_SELF).setup((2, 3, 4), np.int64)
    send = cuda.to_device(np.arange(24, dtype=np.int64).reshape(2, 3, 4))
    recv = cuda.to_device(np.zeros((1, 2, 3, 4), np.int64))
    t.all_gather(send, recv)  # first call: the flat views of send/recv are cached

    def refuse(*args, **kwargs):
        raise AssertionError("allocation or host sync during all_gather")

    for name in ("to_device", "device_array", "pinned_array", "synchronize"):
        monkeypatch.setattr(T.cuda, name, refuse)
    monkeypatch.setattr(I.HostIPCMemory, "allocate", refuse)
    monkeypatch.setattr(I.HostIPCMemory, "synchronize", refuse)
    for round_ in range(3):
        np.asarray(send)[...] += 1
        t.all_gather(send, recv)
        assert np.array_equal(recv.copy_to_host()[0], send.copy_to_host())
    monkeypatch.undo()
    assert t.check()["epoch"] == 4
    t.teardown()


def test_ipc_zero_size_and_repr():
    with T.IPCAllGather(MPI.COMM_SELF).setup((2, 0), np.int64) as t:
        assert t.engine is None and t.state()["epoch"] == 0
        send = cuda.to_device(np.zeros((2, 0), np.int64))
        recv = cuda.to_device(np.zeros((1, 2, 0), np.int64))
        assert t.all_gather(send, recv) is recv
    assert "'ipc'" in repr(t) and T.IPCAllGather.capturable and T.NCCLAllGather.capturable


@sim_only
def test_ipc_setup_failure_is_agreed(monkeypatch):
    def broken(self, nbytes):
        raise MemoryError("no room")

    monkeypatch.setattr(I.HostIPCMemory, "allocate", broken)
    t = T.IPCAllGather(MPI.COMM_SELF)
    with pytest.raises(RankAgreementError, match=r"ipc setup \(allocating.*rank 0: "
                                                 r"MemoryError: no room"):
        t.setup((4,), np.int64)
    assert not t.is_setup


@sim_only
def test_host_shm_is_unlinked_once_published():
    t = T.IPCAllGather(MPI.COMM_SELF).setup((4,), np.int64)
    try:
        region = t._regions[0]
        assert region.keep[2] is None  # the /dev/shm name is gone; the mapping stays
    finally:
        t.teardown()
    leftovers = [n for n in os.listdir(I.HostIPCMemory().directory)
                 if n.startswith(f"numba_cp_ipc_{os.getpid()}_")]
    assert not leftovers


# ---------------------------------------------------------------------------
# Choosing


class FakeComm:
    """A communicator of ``size`` ranks seen from ``rank``: collectives answer for all.

    ``others(call, rank, value)`` gives rank ``rank``'s contribution to the
    ``call``-th allgather (default: the same as ours).
    """

    def __init__(self, size, rank=0, *, shared=True, others=None):
        self.size, self.rank, self.shared = size, rank, shared
        self.others = others or (lambda call, rank, value: value)
        self.calls = []

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def allgather(self, value):
        index = len([c for c in self.calls if c == "allgather"])
        self.calls.append("allgather")
        return [value if r == self.rank else self.others(index, r, value)
                for r in range(self.size)]

    def Split_type(self, kind):
        self.calls.append("Split_type")
        size = self.size if self.shared else 1
        return types.SimpleNamespace(Get_size=lambda: size, Free=lambda: None)


def _probes(monkeypatch, ok=True, why="fake CuPy CUDA IPC", peer=(True, "one shared GPU")):
    monkeypatch.setattr(T, "ipc_probe", lambda: (ok, why))
    monkeypatch.setattr(T, "_gpu_identity", lambda: "0000:1b:00.0")
    monkeypatch.setattr(T, "_peer_access", lambda ids: peer)
    monkeypatch.setenv(T.GPU_AWARE_ENV, "0")


def test_choice_ipc_on_one_node(monkeypatch):
    _probes(monkeypatch)
    for rank in range(4):
        chosen = T.choose_transport(FakeComm(4, rank), device=True)
        assert type(chosen) is T.IPCAllGather and chosen.capturable
        assert chosen.reason.startswith("IPC: all 4 ranks on node ")
        assert "one shared GPU" in chosen.reason


def test_choice_ipc_beats_gpu_aware_mpi(monkeypatch):
    _probes(monkeypatch)
    monkeypatch.setenv(T.GPU_AWARE_ENV, "1")
    assert type(T.choose_transport(FakeComm(2), device=True)) is T.IPCAllGather


def test_choice_two_nodes(monkeypatch):
    _probes(monkeypatch)
    comm = FakeComm(4, shared=False)
    chosen = T.choose_transport(comm, device=True)
    assert type(chosen) is T.StagedMPI
    assert "no IPC: the ranks span more than one node" in chosen.reason
    monkeypatch.setenv(T.GPU_AWARE_ENV, "1")
    assert type(T.choose_transport(FakeComm(4, shared=False), device=True)) is T.DeviceMPI


def test_choice_cupy_missing(monkeypatch):
    _probes(monkeypatch, ok=False, why="CuPy is not importable (ImportError: no cupy)")
    chosen = T.choose_transport(FakeComm(2), device=True)
    assert type(chosen) is T.StagedMPI
    assert "no IPC: ranks 0, 1: CuPy is not importable" in chosen.reason


def test_choice_one_rank_says_no_and_all_agree(monkeypatch):
    """Rank 2's probe fails: every rank (seen from each) falls back, naming rank 2."""
    _probes(monkeypatch)

    def others(call, rank, value):
        if call == 0 and rank == 2:
            return (False, "CuPy is not importable", None, value[3])
        return value

    for me in (0, 1, 3):
        chosen = T.choose_transport(FakeComm(4, me, others=others), device=True)
        assert type(chosen) is T.StagedMPI
        assert chosen.reason.endswith("no IPC: rank 2: CuPy is not importable")


def test_choice_peer_access_missing_on_one_rank(monkeypatch):
    _probes(monkeypatch)

    def others(call, rank, value):
        return (False, "GPU 0000:2a:00.0 is not visible") if (call == 1 and rank == 1) else value

    chosen = T.choose_transport(FakeComm(2, 0, others=others), device=True)
    assert type(chosen) is T.StagedMPI
    assert "rank 1: GPU 0000:2a:00.0 is not visible" in chosen.reason


def test_choice_simulator_keeps_the_mpi_path(monkeypatch):
    if not backend.is_simulator:
        pytest.skip("the simulator's own probe")
    ok, why = T.ipc_probe()
    assert not ok and "simulator" in why
    chosen = T.choose_transport(FakeComm(3), device=True)
    assert type(chosen) is T.StagedMPI and "no IPC: ranks 0, 1, 2: the simulator" in chosen.reason
    assert type(T.choose_transport(FakeComm(3), device=False)) is T.HostMPI


def test_choice_single_rank_asks_nobody(monkeypatch):
    _probes(monkeypatch)

    class Silent(FakeComm):
        def allgather(self, value):
            raise AssertionError("a collective on one rank")

        def Split_type(self, kind):
            raise AssertionError("a collective on one rank")

    chosen = T.choose_transport(Silent(1), device=True)
    assert type(chosen) is T.StagedMPI and "IPC" not in chosen.reason


def test_forcing_skips_the_probes(monkeypatch):
    monkeypatch.setattr(T, "ipc_probe", lambda: pytest.fail("probed"))

    class Silent(FakeComm):
        def allgather(self, value):
            raise AssertionError("forcing must not communicate")

    for name, cls in (("ipc", T.IPCAllGather), ("nccl", T.NCCLAllGather),
                      ("staged", T.StagedMPI)):
        assert type(T.choose_transport(Silent(2), device=True, force=name)) is cls
        monkeypatch.setenv(T.TRANSPORT_ENV, name)
        chosen = T.choose_transport(Silent(2), device=True)
        assert type(chosen) is cls and chosen.reason == f"forced by {T.TRANSPORT_ENV}={name}"
        monkeypatch.delenv(T.TRANSPORT_ENV)
    with pytest.raises(ValueError, match="takes device arrays"):
        T.choose_transport(Silent(2), device=False, force="ipc")
    assert T.takes_device_arrays("ipc") is True and T.takes_device_arrays("nccl") is True


def test_nccl_is_never_chosen_automatically(monkeypatch):
    for ok in (True, False):
        _probes(monkeypatch, ok=ok)
        for aware in ("0", "1"):
            monkeypatch.setenv(T.GPU_AWARE_ENV, aware)
            assert T.choose_transport(FakeComm(2), device=True).name != "nccl"


# -- the local probes against fake CuPy modules


def _fake_cupy(monkeypatch, runtime):
    cupy = types.SimpleNamespace(__version__="14.0.0",
                                 cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(I, "is_simulator", False)
    monkeypatch.setattr(I, "NAME", "cuda")
    monkeypatch.setattr(backend, "COMPILE_ONLY", False)
    return cupy


def _runtime(**extra):
    names = dict.fromkeys(I._IPC_FUNCTIONS, lambda *a: 0)
    names.update(extra)
    return types.SimpleNamespace(**names)


def test_local_probe_fake_cupy(monkeypatch):
    _fake_cupy(monkeypatch, _runtime())
    assert I.local_probe() == (True, "CuPy 14.0.0 CUDA IPC")
    bare = _runtime()
    del bare.ipcOpenMemHandle
    _fake_cupy(monkeypatch, bare)
    ok, why = I.local_probe()
    assert not ok and "lacks ipcOpenMemHandle" in why


def test_local_probe_cupy_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError
    monkeypatch.setattr(I, "is_simulator", False)
    monkeypatch.setattr(I, "NAME", "cuda")
    monkeypatch.setattr(backend, "COMPILE_ONLY", False)
    ok, why = I.local_probe()
    assert not ok and why.startswith("CuPy is not importable (") and "cupy" in why


def test_local_probe_compile_only(monkeypatch):
    monkeypatch.setattr(I, "is_simulator", False)
    monkeypatch.setattr(I, "NAME", "cuda")
    monkeypatch.setattr(backend, "COMPILE_ONLY", True)
    assert I.local_probe()[0] is False


def test_peer_access_fake_cupy(monkeypatch):
    buses = {"0000:1b:00.0": 0, "0000:2a:00.0": 1}

    def by_bus(bus):
        if bus not in buses:
            raise RuntimeError("cudaErrorInvalidDevice")
        return buses[bus]

    can = {(0, 1): 1}
    runtime = _runtime(getDevice=lambda: 0, deviceGetPCIBusId=lambda d: "0000:1B:00.0",
                       deviceGetByPCIBusId=by_bus,
                       deviceCanAccessPeer=lambda a, b: can.get((a, b), 0))
    _fake_cupy(monkeypatch, runtime)
    assert I.gpu_identity() == "0000:1b:00.0"
    assert I.peer_access(["0000:1b:00.0"] * 3) == (True, "one shared GPU")
    assert I.peer_access(["0000:1b:00.0", "0000:2a:00.0"]) == (True, "2 GPUs with peer access")
    ok, why = I.peer_access(["0000:1b:00.0", "0000:99:00.0"])
    assert not ok and "not visible" in why
    can.clear()
    ok, why = I.peer_access(["0000:1b:00.0", "0000:2a:00.0"])
    assert not ok and "cannot access peer GPU 0000:2a:00.0" in why
    assert I.peer_access(["0000:1b:00.0", None])[0] is False


# ---------------------------------------------------------------------------
# NCCL with a fake cupy.cuda.nccl


@pytest.fixture
def fake_nccl(monkeypatch):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import fake_nccl as module
    finally:
        sys.path.remove(str(SCRIPTS))
    module.reset(MPI.COMM_SELF)
    monkeypatch.setattr(T, "_nccl_module", lambda: module)
    return module


@sim_only  # the fake NCCL reads and writes host addresses
def test_nccl_setup_uid_warmup_and_gather(fake_nccl):
    shape = (2, 3, 4)
    t = T.NCCLAllGather(MPI.COMM_SELF).setup(shape, np.int64)
    calls = fake_nccl.CALLS
    assert calls["get_unique_id"] == 1
    (ndev, uid, rank), = calls["init"]
    assert (ndev, rank) == (1, 0) and len(uid) == 128
    # the warm-up: one all-gather of the real payload size, on scratch buffers
    (_, _, count, datatype, _), = calls["allGather"]
    assert count == 24 * 8 and datatype == fake_nccl.NCCL_UINT8
    send = cuda.to_device(np.arange(24, dtype=np.int64).reshape(shape))
    recv = cuda.to_device(np.zeros((1,) + shape, np.int64))
    assert t.all_gather(send, recv, stream=cuda.stream()) is recv
    assert np.array_equal(recv.copy_to_host()[0], send.copy_to_host())
    sendbuf, recvbuf, count, _, stream = calls["allGather"][-1]
    assert (sendbuf, recvbuf, count) == (np.asarray(send).ctypes.data,
                                         np.asarray(recv).ctypes.data, 192)
    assert stream == 0  # the simulator has no stream handles
    t.teardown()
    assert calls["destroy"] == 1


@sim_only  # the fake NCCL reads and writes host addresses
def test_nccl_validation(fake_nccl):
    with T.NCCLAllGather(MPI.COMM_SELF).setup((4,), np.float16) as t:
        with pytest.raises(TypeError, match="send: a host NumPy array"):
            t.all_gather(np.zeros(4, np.float16), cuda.to_device(np.zeros((1, 4), np.float16)))
        both = cuda.to_device(np.zeros((1, 4), np.float16))
        with pytest.raises(ValueError, match="overlaps"):
            t.all_gather(both[0], both)


def test_nccl_missing_is_agreed(monkeypatch):
    def missing():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(T, "_nccl_module", missing)
    t = T.NCCLAllGather(MPI.COMM_SELF)
    with pytest.raises(RankAgreementError, match=r"nccl setup \(loading NCCL\): rank 0: "
                                                 r"ImportError"):
        t.setup((4,), np.int64)
    assert not t.is_setup


@sim_only  # the fake NCCL reads and writes host addresses
def test_nccl_init_failure_destroys_and_agrees(fake_nccl, monkeypatch):
    def broken(self, sendbuf, recvbuf, count, datatype, stream):
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE: duplicate GPU")

    monkeypatch.setattr(fake_nccl.NcclCommunicator, "allGather", broken)
    t = T.NCCLAllGather(MPI.COMM_SELF)
    with pytest.raises(RankAgreementError, match="warm-up.*duplicate GPU"):
        t.setup((4,), np.int64)
    assert fake_nccl.CALLS["destroy"] == 1 and t._comm is None


def test_stream_handle():
    if backend.is_simulator:
        assert T._stream_handle(object()) == 0
        return
    assert T._stream_handle(types.SimpleNamespace(ptr=1234)) == 1234
    assert T._stream_handle(types.SimpleNamespace(cuda_stream=99)) == 99
    assert T._stream_handle(5) == 5


# ---------------------------------------------------------------------------
# Many ranks, under mpiexec


def _environment(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in (T.TRANSPORT_ENV, T.GPU_AWARE_ENV, I.SPIN_LIMIT_ENV)}
    env.update(NUMBA_CP_BACKEND="sim", PYTHONUNBUFFERED="1", **extra)
    return env


def _allgather_check(mpiexec, n, tmp_path, *args):
    out = tmp_path / f"ranks-{n}"
    out.mkdir()
    command = [*mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / "allgather_check.py"),
               "--size", str(n), "--out-dir", str(out), *args]
    status, output = run_mpiexec(command, env=_environment(), cwd=ROOT)
    lines = [line for path in sorted(out.iterdir()) for line in path.read_text().splitlines()]
    return status, lines, output


@pytest.mark.parametrize("n, transports, extra, want", [
    (1, "ipc", [], "ipc"),
    (2, "ipc", [], "ipc"),
    (4, "ipc", [], "ipc"),
    (3, "nccl", ["--fake-nccl"], "nccl"),
    (3, "auto", ["--ipc-probe", "all"], "ipc"),
    (3, "auto", ["--ipc-probe", "0,2"], "staged"),
], ids=["ipc-1", "ipc-2", "ipc-4", "fake-nccl-3", "auto-ipc-3", "auto-rank1-says-no-3"])
def test_device_transports_under_mpiexec(mpiexec, tmp_path, n, transports, extra, want):
    status, lines, output = _allgather_check(mpiexec, n, tmp_path, "--transports", transports,
                                             *extra)
    assert status == 0, output[-4000:]
    oks = [line for line in lines if " OK " in line]
    assert not [line for line in lines if " FAIL " in line or " ERROR " in line], lines
    assert len(oks) == n * 3 * 2, lines  # 3 dtypes x 2 rounds on every rank
    assert all(f"transport={want} asked={transports}" in line for line in oks), oks


def test_main_job_ipc_graph_is_exact(mpiexec, tmp_path):
    import json

    out = tmp_path / "ipc.json"
    command = [*mpiexec, "-n", "3", sys.executable, str(ROOT / "launch" / "exchange.py"),
               "--heads", "2", "--batch", "3", "--context", "4K", "--topk", "8", "--iters", "1",
               "--warmup", "1", "--transport", "ipc", "--graph", "--sparse-table",
               "--json", str(out)]
    status, output = run_mpiexec(command, env=_environment(), cwd=ROOT)
    assert status == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 3 and result["exact"] is True
    assert result["transport"].startswith("ipc (forced")
    assert "graph_replay" in result["stages"]


def test_gpu_check_script_under_the_simulator(mpiexec):
    """launch/ipc_check.py, the script for the GPU machine, runs its checks on the CPU."""
    command = [*mpiexec, "-n", "2", sys.executable, str(ROOT / "launch" / "ipc_check.py"),
               "--replays", "6", "--verify-every", "2", "--calls", "4"]
    status, output = run_mpiexec(command, env=_environment(), cwd=ROOT)
    assert status == 0, output[-4000:]
    verdicts = [line.split()[0] for line in output.splitlines()
                if line.split()[:1] in (["PASS"], ["FAIL"], ["SKIP"])]
    assert "FAIL" not in verdicts and verdicts.count("PASS") >= 8, output[-4000:]
    assert "ipc_check: " in output and " 0 failed" in output


# ---------------------------------------------------------------------------
# The inline PTX assembles


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                    reason="numba-cuda is not installed")
def test_ipc_kernels_assemble_for_sm90():
    """compile_ptx does not run ptxas: nvJitLink turns the PTX into SASS here."""
    if importlib.util.find_spec("cuda.bindings.nvjitlink") is None:
        pytest.skip("no cuda.bindings.nvjitlink")
    code = """
import sys
from numba import types
from cuda.bindings import nvjitlink as J
from numba_cp.backend import cuda
from numba_cp.compile_check import _target_device, ipc_specialisations
NEEDS = {"ipc_push": (b"st.release.sys", b"membar.sys"),
         "ipc_wait_copy": (b"ld.acquire.sys", b"membar.sys", b"nanosleep"), "ipc_bump": ()}
with _target_device((9, 0)):
    for label, fn, sig in ipc_specialisations():
        ptx = cuda.compile_ptx(fn, types.void(*sig), cc=(9, 0))[0].encode()
        for needle in NEEDS[label.split("[")[0]]:
            if needle not in ptx:
                sys.exit(f"{label}: no {needle.decode()} in the PTX")
        options = ["-arch=sm_90"]
        h = J.create(len(options), options)
        J.add_data(h, J.InputType.PTX, ptx, len(ptx), label)
        J.complete(h)
        print(label, J.get_linked_cubin_size(h))
        J.destroy(h)
"""
    env = dict(os.environ, NUMBA_CP_BACKEND="cuda", NUMBA_CP_COMPILE_ONLY="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=280)
    if proc.returncode and "nvJitLink" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("libnvJitLink is not loadable")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(proc.stdout.splitlines()) == 5, proc.stdout
