"""Every transport on one rank, in process: life cycle, validation, sizes, allocation.

A transport is set up once for the largest payload and then gathers any
smaller send of its dtype. Runs on ``MPI.COMM_SELF`` (MPI initialised as a
singleton), and on :class:`FakeComm` where a test needs more ranks without
communication. The expected result of a one-rank gather is the send itself,
byte for byte.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from comm_support import FakeComm, payload  # noqa: E402
from numba_cp.backend import TARGET, cuda  # noqa: E402
from numba_cp.comm import (TRANSPORTS, DeviceMPI, HostMPI, IPCAllGather,  # noqa: E402
                           LeaderAllGather, NCCLAllGather, StagedMPI, Transport, agree,
                           gpu_aware_mpi, register_transport)
from numba_cp.comm.ipc import HostIPCMemory  # noqa: E402
from numba_cp.errors import RankAgreementError  # noqa: E402

SHAPE = (2, 3, 4)
DTYPES = ("int64", "float16", "uint16")
SENTINEL = 0x5A
ALL = [HostMPI, StagedMPI, DeviceMPI, IPCAllGather]
sim_only = pytest.mark.skipif(not TARGET.simulator,
                              reason="IPC on host shared memory exists under the simulator only")


def _usable(cls):
    """DeviceMPI needs MPI that reads device memory; the simulator's is host memory."""
    if cls is DeviceMPI and not TARGET.simulator and not gpu_aware_mpi()[0]:
        pytest.skip("this MPI cannot read device memory")


def _put(cls, host):
    host = np.ascontiguousarray(host)
    return cuda.to_device(host) if cls.device else host.copy()


def _get(array):
    return array.copy_to_host() if hasattr(array, "copy_to_host") else np.array(array)


def _front(cls, shape, dtype, spare):
    """A C-contiguous ``shape`` view at the front of a sentinel-filled buffer with ``spare``
    more elements behind it, and the whole buffer (to see writes past the view)."""
    count = int(np.prod(shape, dtype=np.int64))
    whole = _put(cls, np.full((count + spare) * np.dtype(dtype).itemsize, SENTINEL,
                              np.uint8).view(dtype))
    return whole[:count].reshape(shape), whole


# ---------------------------------------------------------------------------
# Gathers


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_rank_exact(cls, dtype):
    _usable(cls)
    with cls(MPI.COMM_SELF).setup(SHAPE, dtype) as t:
        for round_ in range(2):  # the second call reuses what setup made
            send = payload(0, round_, SHAPE, dtype)
            recv = _put(cls, np.full(send.nbytes, SENTINEL, np.uint8).view(dtype).reshape(
                (1,) + SHAPE))
            assert t.all_gather(_put(cls, send), recv) is recv
            assert _get(recv).tobytes() == send.tobytes()
    assert not t.is_setup


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_set_up_for_the_most_tokens_gathers_fewer(cls):
    """Set up for (heads, T, topk); sends of (heads, t, topk), t <= T, in any order."""
    _usable(cls)
    heads, most, topk = 2, 5, 4
    with cls(MPI.COMM_SELF).setup((heads, most, topk), np.int64) as t:
        assert t.nbytes == heads * most * topk * 8
        for round_, tokens in enumerate((most, 3, 0, 1, most, 2, 0, 4)):
            shape = (heads, tokens, topk)
            want = payload(0, round_, shape, np.int64)
            send, _ = _front(cls, shape, np.int64, spare=7)
            _copy_in(send, want)
            recv, whole = _front(cls, (1,) + shape, np.int64, spare=9)
            assert t.all_gather(send, recv) is recv
            got = _get(whole)
            assert got[:want.size].tobytes() == want.tobytes(), f"tokens={tokens}"
            assert (got[want.size:].view(np.uint8) == SENTINEL).all(), \
                f"tokens={tokens}: bytes past recv were written"


def _copy_in(device_or_host, host):
    if hasattr(device_or_host, "copy_to_device"):
        device_or_host.copy_to_device(np.ascontiguousarray(host))
    else:
        device_or_host[...] = host


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_any_shape_up_to_the_setup_bytes(cls):
    """Only the bytes are bounded: a flat send of all of them, or of a few, gathers."""
    _usable(cls)
    with cls(MPI.COMM_SELF).setup(SHAPE, np.float16) as t:
        for round_, shape in enumerate([(24,), (4, 6), (5,), (1, 1, 1, 1)]):
            want = payload(0, round_, shape, np.float16)
            recv = _put(cls, np.zeros((1,) + shape, np.float16))
            t.all_gather(_put(cls, want), recv)
            assert _get(recv).tobytes() == want.tobytes()


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_send_larger_than_the_setup_is_rejected(cls):
    _usable(cls)
    with cls(MPI.COMM_SELF).setup(SHAPE, np.int64) as t:
        for shape in [(2, 4, 4), (25,), (2, 3, 4, 2)]:
            send = _put(cls, np.ones(shape, np.int64))
            recv = _put(cls, np.zeros((1,) + shape, np.int64))
            with pytest.raises(ValueError, match=r"^send: shape .* more than the 192 "):
                t.all_gather(send, recv)
            assert not _get(recv).any()


@pytest.mark.parametrize("cls", [HostMPI, StagedMPI, DeviceMPI], ids=lambda c: c.name)
def test_per_call_checks_raise_before_communicating(cls):
    """Three ranks, none of which can communicate past setup: every rank raises alike."""
    _usable(cls)

    class NoData(FakeComm):
        def Allgather(self, *args):
            raise AssertionError("the all-gather ran")

        Iallgather = Allgather

    t = cls(NoData(3)).setup(SHAPE, np.int64)
    try:
        for send_shape, recv_shape, message in [
                ((2, 3, 5), (3, 2, 3, 5), "^send: "),
                (SHAPE, (1,) + SHAPE, r"^recv: shape \(1, 2, 3, 4\), expected \(3, 2, 3, 4\)")]:
            with pytest.raises(ValueError, match=message):
                t.all_gather(_put(cls, np.ones(send_shape, np.int64)),
                             _put(cls, np.zeros(recv_shape, np.int64)))
    finally:
        t.teardown()


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_zero_size_payload(cls):
    _usable(cls)
    with cls(MPI.COMM_SELF).setup((2, 0, 4), np.int64) as t:
        assert t.nbytes == 0
        send, recv = _put(cls, np.empty((2, 0, 4), np.int64)), _put(cls, np.empty((1, 2, 0, 4),
                                                                                 np.int64))
        assert t.all_gather(send, recv) is recv
        assert t.all_gather(send, recv) is recv
    assert not t.is_setup


# ---------------------------------------------------------------------------
# The two-level exchange's gather between the nodes' leaders


def _peer_bytes(rank, n):
    """What rank ``rank`` (not this one) sends when it sends ``n`` bytes."""
    return ((np.arange(n) * 7 + 31 * rank + n) % 251).astype(np.uint8)


class LeaderComm(FakeComm):
    """``Iallgatherv`` puts each sending rank's bytes where the counts and displacements
    say (ours from our send, a peer's :func:`_peer_bytes`) and remembers them."""

    def __init__(self, size, rank):
        super().__init__(size, rank)
        self.layouts = []

    def Iallgatherv(self, send, recv):
        (mine, _, _), (out, (counts, displacements), _) = send, recv
        self.layouts.append((list(counts), list(displacements)))
        for r, (n, at) in enumerate(zip(counts, displacements)):
            if n:
                out[at:at + n] = mine[:n] if r == self.rank else _peer_bytes(r, n)
        return types.SimpleNamespace(Test=lambda: True)


@pytest.mark.parametrize("rank", [2, 1], ids=["leader", "not-leader"])
def test_leaders_gather_payloads_of_any_size_in_any_order(rank):
    """Callers send fewer bytes than the gather was made for, changing from call to call:
    every call's counts and displacements follow its own size."""
    leaders = [0, 2, 3]
    comm = LeaderComm(4, rank)
    gather = LeaderAllGather(comm, leaders, nbytes=5 * 8, device=False)
    for round_, count in enumerate((5, 2, 5, 0, 1, 2, 5)):
        n = count * 8
        send = payload(rank, round_, (count,), np.int64)
        recv = np.full((len(leaders), count), -1, np.int64)
        assert gather.all_gather(send, recv) is recv
        want = [send.view(np.uint8) if q == rank else _peer_bytes(q, n) for q in leaders]
        assert recv.tobytes() == np.concatenate(want).tobytes(), f"{n} bytes"
        counts, displacements = comm.layouts[-1]
        assert counts == [n if r in leaders else 0 for r in range(4)]
        assert [displacements[q] for q in leaders] == [0, n, 2 * n]


# ---------------------------------------------------------------------------
# Nothing is allocated per call


def _refuse(*args, **kwargs):
    raise AssertionError("allocation or host synchronisation during all_gather")


def test_staged_allocates_only_at_setup(monkeypatch):
    t = StagedMPI(MPI.COMM_SELF).setup(SHAPE, np.int64)
    send_host, recv_host = t._send_host, t._recv_host
    assert send_host.nbytes == 192 and recv_host.nbytes == 192
    sends = {tokens: cuda.to_device(np.zeros((2, tokens, 4), np.int64)) for tokens in (3, 1)}
    recvs = {tokens: cuda.to_device(np.zeros((1, 2, tokens, 4), np.int64)) for tokens in (3, 1)}
    for allocator in ("pinned_array", "device_array", "to_device", "event", "stream"):
        monkeypatch.setattr(cuda, allocator, _refuse)
    for round_, tokens in enumerate((3, 1, 3)):
        want = payload(0, round_, (2, tokens, 4), np.int64)
        sends[tokens].copy_to_device(want)
        t.all_gather(sends[tokens], recvs[tokens])
        assert t._send_host is send_host and t._recv_host is recv_host
        assert np.array_equal(recvs[tokens].copy_to_host()[0], want)
    monkeypatch.undo()
    t.teardown()
    t.teardown()  # idempotent
    assert t._send_host is None and t._recv_host is None and not t.is_setup


@sim_only
def test_ipc_allocates_only_at_setup(monkeypatch):
    t = IPCAllGather(MPI.COMM_SELF).setup(SHAPE, np.int64)
    sends = {tokens: cuda.to_device(np.zeros((2, tokens, 4), np.int64)) for tokens in (3, 2)}
    recvs = {tokens: cuda.to_device(np.zeros((1, 2, tokens, 4), np.int64)) for tokens in (3, 2)}
    for tokens in sends:  # first calls: the flat views of send/recv are cached
        t.all_gather(sends[tokens], recvs[tokens])
    for name in ("to_device", "device_array", "pinned_array", "synchronize"):
        monkeypatch.setattr(cuda, name, _refuse)
    monkeypatch.setattr(HostIPCMemory, "allocate", _refuse)
    monkeypatch.setattr(HostIPCMemory, "synchronize", _refuse)
    for round_, tokens in enumerate((3, 2, 2, 3)):
        want = payload(0, round_, (2, tokens, 4), np.int64)
        np.asarray(sends[tokens])[...] = want
        t.all_gather(sends[tokens], recvs[tokens])
        assert np.array_equal(recvs[tokens].copy_to_host()[0], want)
    monkeypatch.undo()
    assert t.check()["epoch"] == 6
    t.teardown()


# ---------------------------------------------------------------------------
# Life cycle and validation


def test_life_cycle_errors():
    t = HostMPI(MPI.COMM_SELF)
    send, recv = np.zeros(SHAPE, np.int64), np.zeros((1,) + SHAPE, np.int64)
    with pytest.raises(RuntimeError, match="setup"):
        t.all_gather(send, recv)
    assert t.setup(list(SHAPE), "int64") is t
    assert t.shape == SHAPE and t.dtype == np.int64 and t.nbytes == send.nbytes
    assert repr(t) == "<HostMPI 'host' size=1 shape=(2, 3, 4), dtype=int64>"
    with pytest.raises(RuntimeError, match="already set up"):
        t.setup(SHAPE, np.int64)
    t.teardown()
    with pytest.raises(RuntimeError, match="setup"):
        t.all_gather(send, recv)
    assert "not set up" in repr(t) and t.nbytes == 0
    assert t.setup(7, np.uint8).shape == (7,)  # a bare extent is a 1-D shape
    t.teardown()


@pytest.mark.parametrize("shape, dtype, message", [
    ((2, -1), np.int64, "negative"),
    ((2, 1.5), np.int64, "not a tuple of integers"),
    ("ab", np.int64, "not a tuple of integers"),
    ((2, True), np.int64, "not a tuple of integers"),
    (None, np.int64, "not a tuple of integers"),
    ((2, 3), object, "Python objects"),
    ((2, 3), "no-such-dtype", "not a NumPy dtype"),
])
def test_setup_rejects(shape, dtype, message):
    t = StagedMPI(MPI.COMM_SELF)
    with pytest.raises(RankAgreementError, match=f"^staged setup: rank 0: .*{message}"):
        t.setup(shape, dtype)
    assert not t.is_setup and t._send_host is None


def test_setup_disagreement_is_raised_alike_and_allocates_nothing():
    def others(call, rank, value):
        problem, values, extra = value
        if rank == 1:
            key = next(k for k in values if "buffer" in k)
            return problem, {**values, key: ((2, 4, 4), values[key][1])}, extra
        return value

    t = StagedMPI(FakeComm(3, 2, others=others))
    with pytest.raises(RankAgreementError) as error:
        t.setup(SHAPE, np.int64)
    assert str(error.value) == (
        "staged setup: ranks disagree on the all-gather buffer (every rank must set up the "
        "same shape and dtype): ((2, 3, 4), '<i8') on rank(s) 0, 2; ((2, 4, 4), '<i8') on "
        "rank(s) 1")
    assert not t.is_setup and t._send_host is None


def test_host_validation():
    t = HostMPI(MPI.COMM_SELF).setup(SHAPE, np.int64)
    send, recv = np.zeros(SHAPE, np.int64), np.zeros((1,) + SHAPE, np.int64)
    cases = [
        ((np.zeros((2, 3, 5), np.int64), recv), ValueError,
         r"^send: shape \(2, 3, 5\) is 240 bytes, more than the 192 the host transport was set "
         r"up for \(shape \(2, 3, 4\)\)"),
        ((send.astype(np.int32), recv), TypeError, "send: dtype int32"),
        ((np.zeros((2, 6, 4), np.int64)[:, ::2], recv), ValueError, "send: must be C-contiguous"),
        ((send, np.zeros(SHAPE, np.int64)), ValueError,
         r"recv: shape .*\(comm.size, \*send.shape\)"),
        ((np.zeros((2, 2, 4), np.int64), recv), ValueError,
         r"recv: shape \(1, 2, 3, 4\), expected \(1, 2, 2, 4\)"),
        ((send, recv.astype(np.float64)), TypeError, "recv: dtype float64"),
        ((send.tolist(), recv), TypeError, "send: expected a NumPy array"),
        ((cuda.to_device(send), recv), TypeError, "send: a device array"),
        ((send, recv[:, :, :, ::-1]), ValueError, "recv: must be C-contiguous"),
    ]
    readonly = recv.copy()
    readonly.flags.writeable = False
    cases.append(((send, readonly), ValueError, "recv: is read-only"))
    both = np.zeros((1,) + SHAPE, np.int64)
    cases.append(((both[0], both), ValueError, "recv: overlaps send"))
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            t.all_gather(*args)
    assert not recv.any()
    t.teardown()


@pytest.mark.parametrize("cls", [StagedMPI, DeviceMPI, IPCAllGather], ids=lambda c: c.name)
def test_device_validation(cls):
    _usable(cls)
    t = cls(MPI.COMM_SELF).setup(SHAPE, np.float16)
    send = cuda.to_device(np.ones(SHAPE, np.float16))
    recv = cuda.to_device(np.zeros((1,) + SHAPE, np.float16))
    wide = cuda.to_device(np.zeros((2, 3, 8), np.float16))
    cases = [
        ((np.ones(SHAPE, np.float16), recv), TypeError, "send: a host NumPy array"),
        ((send, np.zeros((1,) + SHAPE, np.float16)), TypeError, "recv: a host NumPy array"),
        ((cuda.to_device(np.ones(SHAPE, np.float32)), recv), TypeError, "send: dtype float32"),
        ((send, cuda.to_device(np.zeros((2,) + SHAPE, np.float16))), ValueError, "recv: shape"),
        ((wide[:, :, ::2], recv), ValueError, "send: must be C-contiguous"),
        ((wide, cuda.to_device(np.zeros((1, 2, 3, 8), np.float16))), ValueError,
         r"^send: shape \(2, 3, 8\) is 96 bytes, more than the 48"),
        ((object(), recv), TypeError, "send"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            t.all_gather(*args)
    assert not recv.copy_to_host().any()
    t.teardown()


def test_capturable_and_device_flags():
    assert [cls.device for cls in (HostMPI, DeviceMPI, StagedMPI, IPCAllGather,
                                   NCCLAllGather)] == [False, True, True, True, True]
    assert [cls.capturable for cls in (HostMPI, DeviceMPI, StagedMPI, IPCAllGather,
                                       NCCLAllGather)] == [False, False, False, True, True]


# ---------------------------------------------------------------------------
# The registry and the agreement helper


def test_registry_refuses_taken_and_missing_names():
    class Other(Transport):
        name = "staged"

    with pytest.raises(ValueError, match="taken by StagedMPI"):
        register_transport(Other)
    assert TRANSPORTS["staged"] is StagedMPI

    class Nameless(Transport):
        pass

    with pytest.raises(ValueError, match="needs a name"):
        register_transport(Nameless)
    assert register_transport(StagedMPI) is StagedMPI  # registering again is harmless


def test_agree_returns_every_payload():
    def others(call, rank, value):
        return value[:2] + (f"from {rank}",)

    comm = FakeComm(3, 1, others=others)
    assert agree(comm, "x", values={"n": 4}, payload="mine") == ["from 0", "mine", "from 2"]
    assert comm.calls == ["allgather"]  # one collective


def test_agree_names_the_ranks_with_a_problem_and_cleans_up():
    cleaned = []

    def others(call, rank, value):
        return ("no room", {}, None) if rank in (0, 3) else value

    with pytest.raises(RankAgreementError,
                       match=r"^thing setup: rank 0: no room; rank 3: no room$"):
        agree(FakeComm(4, 1, others=others), "thing setup", values={"n": 4},
              cleanup=lambda: cleaned.append(True))
    assert cleaned == [True]


def test_agree_names_the_first_differing_value():
    cleaned = []

    def others(call, rank, value):
        return (None, {"a": 1, "b": rank % 2}, None)

    with pytest.raises(RankAgreementError,
                       match=r"^thing: ranks disagree on b: 0 on rank\(s\) 0, 2; 1 on rank\(s\) "
                             r"1, 3$"):
        agree(FakeComm(4, 0, others=others), "thing", values={"a": 1, "b": 0},
              cleanup=lambda: cleaned.append(True))
    assert cleaned == [True]
    assert agree(FakeComm(4), "thing", values={"a": 1}, cleanup=lambda: cleaned.append(1)) \
        == [None] * 4
    assert cleaned == [True]
