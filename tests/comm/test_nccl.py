"""NCCLAllGather against a stand-in ``cupy.cuda.nccl`` (``mpi_scripts/fake_nccl.py``).

The stand-in all-gathers host addresses over MPI, so it runs under the
simulator, whose device arrays are host memory, and checks what the real NCCL
needs of its callers (one unique id, made by rank 0 only). Each test loads a
fresh copy of it, handed to the transport through ``module=``.
"""

from __future__ import annotations

import importlib.util
import types

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from comm_support import load_script_module, payload  # noqa: E402
from numba_cp.arrays import stream_handle  # noqa: E402
from numba_cp.backend import TARGET, cuda  # noqa: E402
from numba_cp.comm import NCCLAllGather  # noqa: E402
from numba_cp.errors import RankAgreementError  # noqa: E402

# the stand-in reads and writes host addresses
sim_only = pytest.mark.skipif(not TARGET.simulator, reason="the stand-in NCCL needs host memory")


@pytest.fixture
def fake_nccl():
    module = load_script_module("fake_nccl")
    module.reset(MPI.COMM_SELF)
    return module


@sim_only
def test_setup_uid_warmup_and_gather(fake_nccl):
    shape = (2, 3, 4)
    t = NCCLAllGather(MPI.COMM_SELF, module=fake_nccl).setup(shape, np.int64)
    calls = fake_nccl.CALLS
    assert calls["get_unique_id"] == 1
    (ndev, uid, rank), = calls["init"]
    assert (ndev, rank) == (1, 0) and len(uid) == 128
    # the warm-up: one all-gather of the largest payload, on scratch buffers
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


@sim_only
def test_smaller_sends_move_only_their_bytes(fake_nccl):
    with NCCLAllGather(MPI.COMM_SELF, module=fake_nccl).setup((2, 5, 4), np.int64) as t:
        for round_, tokens in enumerate((2, 5, 1)):
            want = payload(0, round_, (2, tokens, 4), np.int64)
            recv = cuda.to_device(np.zeros((1, 2, tokens, 4), np.int64))
            t.all_gather(cuda.to_device(want), recv)
            assert np.array_equal(recv.copy_to_host()[0], want)
            assert fake_nccl.CALLS["allGather"][-1][2] == want.nbytes
        calls = len(fake_nccl.CALLS["allGather"])
        t.all_gather(cuda.to_device(np.zeros((2, 0, 4), np.int64)),
                     cuda.to_device(np.zeros((1, 2, 0, 4), np.int64)))
        assert len(fake_nccl.CALLS["allGather"]) == calls  # nothing to move, no call
        with pytest.raises(ValueError, match="^send: "):
            t.all_gather(cuda.to_device(np.zeros((2, 6, 4), np.int64)),
                         cuda.to_device(np.zeros((1, 2, 6, 4), np.int64)))


@sim_only
def test_validation(fake_nccl):
    with NCCLAllGather(MPI.COMM_SELF, module=fake_nccl).setup((4,), np.float16) as t:
        with pytest.raises(TypeError, match="send: a host NumPy array"):
            t.all_gather(np.zeros(4, np.float16), cuda.to_device(np.zeros((1, 4), np.float16)))
        both = cuda.to_device(np.zeros((1, 4), np.float16))
        with pytest.raises(ValueError, match="overlaps"):
            t.all_gather(both[0], both)
    assert len(fake_nccl.CALLS["allGather"]) == 1  # the warm-up only


def test_loading_failure_is_agreed():
    def no_id():
        raise ImportError("libnccl.so.2: cannot open shared object file")

    t = NCCLAllGather(MPI.COMM_SELF, module=types.SimpleNamespace(get_unique_id=no_id))
    with pytest.raises(RankAgreementError, match=r"^nccl setup \(loading NCCL\): rank 0: "
                                                 r"ImportError: libnccl"):
        t.setup((4,), np.int64)
    assert not t.is_setup


def test_missing_cupy_is_agreed():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed")
    t = NCCLAllGather(MPI.COMM_SELF)  # the real cupy.cuda.nccl
    with pytest.raises(RankAgreementError, match=r"^nccl setup \(loading NCCL\): rank 0: "
                                                 r"ModuleNotFoundError: .*cupy"):
        t.setup((4,), np.int64)
    assert not t.is_setup


@sim_only
def test_warmup_failure_destroys_and_agrees(fake_nccl):
    class Refusing(fake_nccl.NcclCommunicator):
        def allGather(self, sendbuf, recvbuf, count, datatype, stream):
            raise RuntimeError("NCCL_ERROR_INVALID_USAGE: duplicate GPU")

    fake_nccl.NcclCommunicator = Refusing
    t = NCCLAllGather(MPI.COMM_SELF, module=fake_nccl)
    with pytest.raises(RankAgreementError, match="warm-up.*duplicate GPU"):
        t.setup((4,), np.int64)
    assert fake_nccl.CALLS["destroy"] == 1 and t._comm is None and not t.is_setup


def test_stream_handle():
    if TARGET.simulator:
        assert stream_handle(object()) == 0
        assert stream_handle(None) == 0
        return
    assert stream_handle(types.SimpleNamespace(ptr=1234)) == 1234
    assert stream_handle(types.SimpleNamespace(cuda_stream=99)) == 99
    assert stream_handle(5) == 5
    assert stream_handle(0) == 0
