"""IPCAllGather on one rank: its error reporting, timeout, setup failures and clean-up.

Under the simulator its exchange buffers are files in ``/dev/shm`` mapped by
every rank (:class:`~numba_cp.comm.ipc.HostIPCMemory`); the multi-rank runs
are in ``test_mpi_jobs.py`` and, on a GPU, ``test_ipc_device.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from comm_support import payload  # noqa: E402
from numba_cp.backend import TARGET, cuda  # noqa: E402
from numba_cp.comm import IPCAllGather  # noqa: E402
from numba_cp.comm import ipc as I  # noqa: E402
from numba_cp.errors import IPCTimeoutError, RankAgreementError  # noqa: E402
from numba_cp.kernels import ipc as K  # noqa: E402

sim_only = pytest.mark.skipif(not TARGET.simulator,
                              reason="IPC on host shared memory exists under the simulator only")


@sim_only
def test_check_reports_timeout_and_poison():
    t = IPCAllGather(MPI.COMM_SELF, timeout=0.5).setup((4,), np.int64)
    try:
        send = cuda.to_device(np.arange(4, dtype=np.int64))
        recv = cuda.to_device(np.zeros((1, 4), np.int64))
        t.all_gather(send, recv)
        assert t.check()["epoch"] == 1
        # what the wait kernel records when it gives up, and what a peer's poison leaves
        t.engine.ctrl[K.ERR_EPOCH] = 7
        t.engine.ctrl[K.ERR_PEER] = 3
        with pytest.raises(IPCTimeoutError, match="call 7 gave up waiting for rank 2 after 0.5 s"):
            t.check()
        t.engine.ctrl[K.ERR_EPOCH] = 0
        np.asarray(t.engine.own_flags)[-1] = 2
        with pytest.raises(IPCTimeoutError, match="rank 1 gave up"):
            t.check()
    finally:
        t.teardown()
    assert t.engine is None and not t.is_setup
    with pytest.raises(RuntimeError, match="setup"):
        t.state()


def test_timeout_env(monkeypatch):
    assert IPCAllGather(MPI.COMM_SELF).timeout == I.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(I.TIMEOUT_ENV, "2.5")
    assert IPCAllGather(MPI.COMM_SELF).timeout == 2.5
    assert I.timeout_from_env() == 2.5
    assert IPCAllGather(MPI.COMM_SELF, timeout=9).timeout == 9
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv(I.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=I.TIMEOUT_ENV):
            IPCAllGather(MPI.COMM_SELF)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        IPCAllGather(MPI.COMM_SELF, timeout=0)


@sim_only
def test_failure_is_read_from_the_error_words_without_a_sync():
    """What the plan asks before every call: the error words the wait kernel writes."""
    t = IPCAllGather(MPI.COMM_SELF, timeout=0.5).setup((4,), np.int64)
    try:
        assert t.failure() is None
        errors = np.asarray(t.engine.errors)
        errors[K.GAVE_UP_EPOCH], errors[K.GAVE_UP_PEER] = 5, 2
        assert t.failure() == "ipc rank 0: call 5 gave up waiting for rank 1 after 0.5 s"
        errors[:] = 0
        errors[K.POISONED_BY] = 3
        assert t.failure() == "ipc rank 0: rank 2 gave up waiting for a peer"
    finally:
        t.teardown()


def test_zero_size_state_and_repr():
    with IPCAllGather(MPI.COMM_SELF).setup((2, 0), np.int64) as t:
        assert t.engine is None and t.state()["epoch"] == 0 and t.check()["flags"] == []
        send = cuda.to_device(np.zeros((2, 0), np.int64))
        recv = cuda.to_device(np.zeros((1, 2, 0), np.int64))
        assert t.all_gather(send, recv) is recv
        assert "'ipc'" in repr(t) and "shape=(2, 0)" in repr(t)


@sim_only
def test_zero_token_call_moves_nothing_and_keeps_the_epoch():
    """A call with nothing to send launches nothing: the device epoch stays where it was."""
    with IPCAllGather(MPI.COMM_SELF).setup((2, 3, 4), np.int64) as t:
        full = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
        recv = cuda.to_device(np.zeros((1, 2, 3, 4), np.int64))
        t.all_gather(cuda.to_device(full), recv)
        t.all_gather(cuda.to_device(np.zeros((2, 0, 4), np.int64)),
                     cuda.to_device(np.zeros((1, 2, 0, 4), np.int64)))
        assert t.check()["epoch"] == 1
        one = np.ascontiguousarray(full[:, :1])
        recv_one = cuda.to_device(np.zeros((1, 2, 1, 4), np.int64))
        t.all_gather(cuda.to_device(one), recv_one)
        assert t.check()["epoch"] == 2
        assert np.array_equal(recv_one.copy_to_host()[0], one)


@sim_only
def test_separate_gathers_launch_through_launches_built_once_per_size(monkeypatch):
    """Bump, push and wait-copy go through KernelLaunch objects (the direct launch on
    numba-cuda); a payload size seen before builds none, whatever the buffers."""
    built, called = [], []

    class Counted(I.KernelLaunch):
        def __init__(self, kernel, *args, **kwargs):
            super().__init__(kernel, *args, **kwargs)
            built.append(kernel)

        def __call__(self, objects, stream=None, pointers=None):
            called.append(self.kernel)
            return super().__call__(objects, stream, pointers)

    monkeypatch.setattr(I, "KernelLaunch", Counted)
    separate = [K.ipc_bump_kernel, K.ipc_push_kernel, K.ipc_wait_copy_kernel]
    with IPCAllGather(MPI.COMM_SELF).setup((2, 3, 4), np.int64) as t:
        assert len(built) == 2 and set(built) == {K.ipc_wait_kernel, K.ipc_bump_kernel}
        at_setup = len(built)

        def gather(tokens, round_):
            want = payload(0, round_, (2, tokens, 4), np.int64)
            recv = cuda.to_device(np.zeros((1, 2, tokens, 4), np.int64))
            t.all_gather(cuda.to_device(want), recv)  # new buffers every call
            assert np.array_equal(recv.copy_to_host()[0], want)

        gather(3, 0)
        assert built[at_setup:] == separate[1:]
        for round_ in (1, 2, 3):
            gather(3, round_)
        assert len(built) == at_setup + 2 and called == separate * 4
        gather(2, 4)  # a smaller payload: its own push and wait-copy, once
        assert built[at_setup + 2:] == separate[1:]
        for round_, tokens in enumerate((3, 2, 2, 3), start=5):
            gather(tokens, round_)
        assert len(built) == at_setup + 4 and called == separate * 9
        assert t.check()["epoch"] == 9


@sim_only
def test_a_pair_of_signatures_seen_before_is_not_validated_again(monkeypatch):
    """What the per-call checks look at follows from the arrays' signatures, except the
    overlap of send and recv, which every call checks; a new signature, or a new setup,
    is validated again. (The simulator's arrays have no signature: here they are given
    one, as a GPU's are.)"""
    def signature(array):
        host = np.asarray(array)
        return (host.dtype.str, host.shape, host.strides, False), host.ctypes.data

    checked = []
    device_pair = IPCAllGather._device_pair
    monkeypatch.setattr(I, "array_signature", signature)
    monkeypatch.setattr(IPCAllGather, "_device_pair",
                        lambda self, send, recv: checked.append(1) or device_pair(self, send, recv))
    t = IPCAllGather(MPI.COMM_SELF).setup((2, 3, 4), np.int64)
    try:
        for round_ in range(3):
            want = payload(0, round_, (2, 3, 4), np.int64)
            recv = cuda.to_device(np.zeros((1, 2, 3, 4), np.int64))
            t.all_gather(cuda.to_device(want), recv)
            assert np.array_equal(recv.copy_to_host()[0], want)
        assert len(checked) == 1
        whole = cuda.to_device(np.zeros(48, np.int64))
        with pytest.raises(ValueError, match="recv: overlaps send"):
            t.all_gather(whole[:24].reshape(2, 3, 4), whole[12:36].reshape(1, 2, 3, 4))
        assert len(checked) == 1, "the same signatures: only the overlap is checked"
        with pytest.raises(TypeError, match="send: dtype int32"):
            t.all_gather(cuda.to_device(np.zeros((2, 3, 4), np.int32)),
                         cuda.to_device(np.zeros((1, 2, 3, 4), np.int32)))
        with pytest.raises(ValueError, match=r"recv: shape \(2, 2, 3, 4\)"):
            t.all_gather(cuda.to_device(np.zeros((2, 3, 4), np.int64)),
                         cuda.to_device(np.zeros((2, 2, 3, 4), np.int64)))
        assert t.check()["epoch"] == 3
        t.teardown()
        t.setup((2, 1, 4), np.int64)  # smaller: the pair above is too large now
        with pytest.raises(ValueError, match=r"send: shape \(2, 3, 4\) is 192 bytes"):
            t.all_gather(cuda.to_device(np.zeros((2, 3, 4), np.int64)),
                         cuda.to_device(np.zeros((1, 2, 3, 4), np.int64)))
    finally:
        t.teardown()


@sim_only
def test_setup_failure_is_agreed(monkeypatch):
    def broken(self, nbytes):
        raise MemoryError("no room")

    monkeypatch.setattr(I.HostIPCMemory, "allocate", broken)
    t = IPCAllGather(MPI.COMM_SELF)
    with pytest.raises(RankAgreementError, match=r"ipc setup \(allocating.*rank 0: "
                                                 r"MemoryError: no room"):
        t.setup((4,), np.int64)
    assert not t.is_setup and t.engine is None


@sim_only
def test_host_shm_is_unlinked_once_published():
    mine = f"numba_cp_ipc_{os.getpid()}_"
    directory = I.HostIPCMemory().directory
    t = IPCAllGather(MPI.COMM_SELF).setup((4,), np.int64)
    try:
        region = t._regions[0]
        assert region.keep[2] is None  # the /dev/shm name is gone; the mapping stays
        assert not [n for n in os.listdir(directory) if n.startswith(mine)]
        send = cuda.to_device(np.arange(4, dtype=np.int64))
        recv = cuda.to_device(np.zeros((1, 4), np.int64))
        t.all_gather(send, recv)  # still usable through the mapping
        assert np.array_equal(recv.copy_to_host()[0], np.arange(4))
    finally:
        t.teardown()
    assert not [n for n in os.listdir(directory) if n.startswith(mine)]


def test_layout_sizes_every_slot_for_the_largest_payload():
    t = IPCAllGather(MPI.COMM_SELF).setup((2, 5, 4), np.int64)
    try:
        assert t.layout.nbytes == 320 and t.layout.slot_bytes == 512
        assert t.layout.total_bytes == 256 + 2 * 1 * 512
    finally:
        t.teardown()
    assert t.layout is None


def test_uncached_hip_memory_is_whole_pages_and_errors_name_the_call(monkeypatch):
    """The one ctypes call into the HIP runtime, against a stand-in library."""
    import ctypes

    from numba_cp.comm import _hip

    calls = []

    class FakeHip:
        def hipExtMallocWithFlags(self, pointer, size, flags):
            calls.append((size, flags))
            if size > 8192:
                return 2  # hipErrorOutOfMemory
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_void_p))[0] = 0x7000
            return 0

        def hipGetErrorString(self, status):
            return b"out of memory"

    monkeypatch.setattr(_hip, "_library", lambda: FakeHip())
    assert _hip.malloc_uncached(1000) == 0x7000
    assert calls == [(4096, 0x3)]  # a whole page, hipDeviceMallocUncached
    assert _hip.malloc_uncached(4097) == 0x7000 and calls[-1] == (8192, 0x3)
    with pytest.raises(RuntimeError, match=r"hipExtMallocWithFlags\(12288, hipDeviceMalloc"
                                           r"Uncached\) failed: out of memory \(2\)"):
        _hip.malloc_uncached(9000)
