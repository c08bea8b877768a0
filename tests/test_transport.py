"""numba_cp.transport: the all-gather transports, their choice and GPU-aware detection.

In-process tests (on ``MPI.COMM_SELF``, MPI initialized as a singleton) cover
validation, the transport choice and the ctypes GPU-support queries; the
multi-rank tests run ``tests/mpi_scripts/allgather_check.py`` under
``mpiexec -n N`` with ``NUMBA_CP_BACKEND=sim``. The mpiexec is the one beside
``sys.executable`` (a virtualenv's, matching its MPI wheel), else the first on
PATH; ``NUMBA_CP_MPIEXEC_FLAGS`` adds launcher flags (e.g. ``-launcher fork``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from numba_cp import backend  # noqa: E402
from numba_cp import transport as T  # noqa: E402
from numba_cp.backend import cuda  # noqa: E402
from support import run_mpiexec  # noqa: E402

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mpi_scripts" / "allgather_check.py"
SHAPE = (2, 3, 4)
DTYPES = ("int64", "float16", "uint16")
ROUNDS = 2
ENV_VARS = (T.TRANSPORT_ENV, T.GPU_AWARE_ENV, "MPICH_GPU_SUPPORT_ENABLED")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    T._probe.cache_clear()
    yield
    T._probe.cache_clear()


def _device_array(host):
    return cuda.to_device(np.ascontiguousarray(host))


def _device_ok(cls):
    """DeviceMPI needs MPI that reads device memory; the simulator's is host memory."""
    return not (cls is T.DeviceMPI and not backend.is_simulator and not T.gpu_aware_mpi()[0])


# ---------------------------------------------------------------------------
# GPU-aware detection


@pytest.mark.parametrize("backend_name", ["cuda", "hip", "sim"])
def test_gpu_aware_env_forces_answer(monkeypatch, backend_name):
    monkeypatch.setenv(T.GPU_AWARE_ENV, "1")
    aware, reason = T.gpu_aware_mpi(backend_name)
    assert aware is True and T.GPU_AWARE_ENV in reason
    monkeypatch.setenv(T.GPU_AWARE_ENV, "0")
    aware, reason = T.gpu_aware_mpi(backend_name)
    assert aware is False and T.GPU_AWARE_ENV in reason
    monkeypatch.setenv(T.GPU_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match=T.GPU_AWARE_ENV):
        T.gpu_aware_mpi(backend_name)


def test_gpu_aware_env_beats_library(monkeypatch):
    monkeypatch.setattr(T, "_libmpi_handles", lambda: pytest.fail("library asked"))
    monkeypatch.setenv(T.GPU_AWARE_ENV, "1")
    assert T.gpu_aware_mpi("cuda")[0] is True


def test_gpu_aware_sim_and_bad_name():
    assert T.gpu_aware_mpi("sim") == (False, "the sim backend has no device memory for MPI to read")
    with pytest.raises(ValueError, match="backend_name"):
        T.gpu_aware_mpi("opencl")


def test_gpu_aware_probes_this_library():
    """The real ctypes path on the MPI mpi4py loaded (MPICH's wheel here)."""
    if sys.platform.startswith("linux"):
        handles = T._libmpi_handles()
        assert handles, "no handle on the MPI library's symbols"
        assert all(T._symbol(lib, "MPI_Get_library_version") is not None for lib, _ in handles)
    cuda_answer, cuda_reason = T.gpu_aware_mpi("cuda")
    hip_answer, hip_reason = T.gpu_aware_mpi("hip")
    assert isinstance(cuda_answer, bool) and isinstance(hip_answer, bool)
    version = MPI.Get_library_version()
    if MPI.get_vendor()[0] == "MPICH" and "CRAY" not in version.upper() \
            and version.startswith("MPICH Version"):
        assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA=0)" in cuda_reason
        assert "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_HIP=2)" in hip_reason


_GPU_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_INT_QUERY = ctypes.CFUNCTYPE(ctypes.c_int)


def _fake_lib(**symbols):
    return types.SimpleNamespace(MPI_Init=object(), **symbols)


def test_gpu_aware_mpich_query(monkeypatch):
    seen = []

    def query(gpu_type, is_supported):
        seen.append(gpu_type)
        is_supported[0] = 1 if gpu_type == T.MPIX_GPU_SUPPORT_CUDA else 0
        return 0

    callback = _GPU_QUERY(query)
    # MPIX_Query_cuda_support must not be consulted when MPIX_GPU_query_support exists
    lib = _fake_lib(MPIX_GPU_query_support=callback,
                    MPIX_Query_cuda_support=_INT_QUERY(lambda: 0))
    monkeypatch.setattr(T, "_libmpi_handles", lambda: [(lib, "fake-mpich")])
    assert T.gpu_aware_mpi("cuda")[0] is True
    assert T.gpu_aware_mpi("hip")[0] is False
    assert seen == [0, 2]  # MPIX_GPU_SUPPORT_CUDA, MPIX_GPU_SUPPORT_HIP


def test_gpu_aware_mpich_query_error(monkeypatch):
    lib = _fake_lib(MPIX_GPU_query_support=_GPU_QUERY(lambda gpu_type, out: 17))
    monkeypatch.setattr(T, "_libmpi_handles", lambda: [(lib, "fake")])
    aware, reason = T.gpu_aware_mpi("cuda")
    assert aware is False and "error 17" in reason


def test_gpu_aware_open_mpi_queries(monkeypatch):
    lib = _fake_lib(MPIX_Query_cuda_support=_INT_QUERY(lambda: 1),
                    MPIX_Query_rocm_support=_INT_QUERY(lambda: 0))
    monkeypatch.setattr(T, "_libmpi_handles", lambda: [(lib, "fake-ompi")])
    aware, reason = T.gpu_aware_mpi("cuda")
    assert aware is True and "MPIX_Query_cuda_support() gave 1" in reason
    aware, reason = T.gpu_aware_mpi("hip")
    assert aware is False and "MPIX_Query_rocm_support() gave 0" in reason


def test_gpu_aware_missing_symbols(monkeypatch):
    monkeypatch.setattr(T, "_libmpi_handles", lambda: [(_fake_lib(), "bare")])
    aware, reason = T.gpu_aware_mpi("cuda")
    assert aware is False and "no GPU-support query" in reason and T.GPU_AWARE_ENV in reason
    T._probe.cache_clear()
    monkeypatch.setattr(T, "_libmpi_handles", lambda: [])
    aware, reason = T.gpu_aware_mpi("hip")
    assert aware is False and "no handle" in reason


def test_gpu_aware_cray_env(monkeypatch):
    monkeypatch.setattr(MPI, "Get_library_version",
                        lambda: "MPI VERSION    : CRAY MPICH version 8.1.30.8 (ANL base 3.4a2)")
    monkeypatch.setattr(T, "_libmpi_handles", lambda: pytest.fail("Cray decides by its env"))
    aware, reason = T.gpu_aware_mpi("cuda")
    assert aware is False and "MPICH_GPU_SUPPORT_ENABLED" in reason
    T._probe.cache_clear()
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    assert T.gpu_aware_mpi("hip")[0] is True


# ---------------------------------------------------------------------------
# Choosing


def test_choose_default(monkeypatch):
    comm = MPI.COMM_SELF
    assert type(T.choose_transport(comm, device=False)) is T.HostMPI
    monkeypatch.setenv(T.GPU_AWARE_ENV, "0")
    chosen = T.choose_transport(comm, device=True)
    assert type(chosen) is T.StagedMPI and T.GPU_AWARE_ENV in chosen.reason
    monkeypatch.setenv(T.GPU_AWARE_ENV, "1")
    assert type(T.choose_transport(comm, device=True)) is T.DeviceMPI
    if backend.is_simulator:
        monkeypatch.delenv(T.GPU_AWARE_ENV)
        assert type(T.choose_transport(comm, device=True)) is T.StagedMPI


@pytest.mark.parametrize("name, device, cls", [
    ("host", False, T.HostMPI), ("mpi-device", True, T.DeviceMPI), ("staged", True, T.StagedMPI)])
def test_choose_forced(monkeypatch, name, device, cls):
    comm = MPI.COMM_SELF
    assert type(T.choose_transport(comm, device=device, force=name)) is cls
    assert type(T.choose_transport(comm, device=device, force=name.upper())) is cls
    monkeypatch.setenv(T.TRANSPORT_ENV, name)
    chosen = T.choose_transport(comm, device=device)
    assert type(chosen) is cls and chosen.name == name and T.TRANSPORT_ENV in chosen.reason
    with pytest.raises(ValueError, match="device="):
        T.choose_transport(comm, device=not device)


def test_choose_force_beats_env(monkeypatch):
    monkeypatch.setenv(T.TRANSPORT_ENV, "mpi-device")
    assert type(T.choose_transport(MPI.COMM_SELF, device=True, force="staged")) is T.StagedMPI


def test_choose_unknown_lists_choices(monkeypatch):
    choices = ", ".join(sorted(T.TRANSPORTS))
    assert choices == "host, ipc, mpi-device, nccl, staged"
    with pytest.raises(ValueError, match=f"'rdma'.*{choices}"):
        T.choose_transport(MPI.COMM_SELF, device=True, force="rdma")
    monkeypatch.setenv(T.TRANSPORT_ENV, "bogus")
    with pytest.raises(ValueError, match=f"{T.TRANSPORT_ENV}='bogus'.*{choices}"):
        T.choose_transport(MPI.COMM_SELF, device=True)


def test_registry_refuses_taken_name():
    class Other(T.Transport):
        name = "staged"

    with pytest.raises(ValueError, match="taken"):
        T.register_transport(Other)
    assert T.TRANSPORTS["staged"] is T.StagedMPI


# ---------------------------------------------------------------------------
# Single rank, in process


@pytest.mark.parametrize("cls", [T.HostMPI, T.StagedMPI, T.DeviceMPI, T.IPCAllGather],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_rank_exact(cls, dtype):
    if not _device_ok(cls):
        pytest.skip("this MPI cannot read device memory")
    rng = np.random.default_rng(7)
    with cls(MPI.COMM_SELF).setup(SHAPE, dtype) as t:
        for _ in range(2):  # the second call reuses what setup made
            bits = rng.integers(0, 256, size=int(np.prod(SHAPE)) * np.dtype(dtype).itemsize,
                                dtype=np.uint8)
            send = bits.view(dtype).reshape(SHAPE)
            fill = np.full(send.nbytes, 0x5A, np.uint8).view(dtype).reshape((1,) + SHAPE)
            if cls.device:
                recv = _device_array(fill)
                assert t.all_gather(_device_array(send), recv) is recv
                got = recv.copy_to_host()
            else:
                recv = fill.copy()
                assert t.all_gather(send, recv) is recv
                got = recv
            assert got.tobytes() == send.tobytes()
    assert not t.is_setup


def test_zero_size_payload():
    for cls in (T.HostMPI, T.StagedMPI, T.IPCAllGather):
        with cls(MPI.COMM_SELF).setup((2, 0, 4), np.int64) as t:
            send, recv = np.empty((2, 0, 4), np.int64), np.empty((1, 2, 0, 4), np.int64)
            if cls.device:
                send, recv = _device_array(send), _device_array(recv)
            assert t.all_gather(send, recv) is recv


def test_staged_allocates_only_at_setup(monkeypatch):
    t = T.StagedMPI(MPI.COMM_SELF).setup(SHAPE, np.int64)
    send_host, recv_host = t._send_host, t._recv_host
    assert send_host.shape == SHAPE and recv_host.shape == (1,) + SHAPE
    send = np.arange(np.prod(SHAPE), dtype=np.int64).reshape(SHAPE)
    d_send, d_recv = _device_array(send), _device_array(np.zeros((1,) + SHAPE, np.int64))

    def refuse(*args, **kwargs):
        raise AssertionError("allocation during all_gather")

    for allocator in ("pinned_array", "device_array", "to_device", "event", "stream"):
        monkeypatch.setattr(T.cuda, allocator, refuse)
    for round_ in range(3):
        d_send.copy_to_device(send + round_)
        t.all_gather(d_send, d_recv)
        assert t._send_host is send_host and t._recv_host is recv_host
        assert np.array_equal(d_recv.copy_to_host()[0], send + round_)
    monkeypatch.undo()
    t.teardown()
    t.teardown()  # idempotent
    assert t._send_host is None and t._recv_host is None and not t.is_setup


def test_life_cycle_errors():
    t = T.HostMPI(MPI.COMM_SELF)
    send, recv = np.zeros(SHAPE, np.int64), np.zeros((1,) + SHAPE, np.int64)
    with pytest.raises(RuntimeError, match="setup"):
        t.all_gather(send, recv)
    t.setup(list(SHAPE), "int64")
    assert t.shape == SHAPE and t.recv_shape == (1,) + SHAPE and t.nbytes == send.nbytes
    with pytest.raises(RuntimeError, match="already set up"):
        t.setup(SHAPE, np.int64)
    t.teardown()
    with pytest.raises(RuntimeError, match="setup"):
        t.all_gather(send, recv)
    assert "not set up" in repr(t)


@pytest.mark.parametrize("shape, dtype, message", [
    ((2, -1), np.int64, "negative"),
    ((2, 1.5), np.int64, "not a tuple of integers"),
    ("ab", np.int64, "not a tuple of integers"),
    ((2, 3), object, "Python objects"),
    ((2, 3), "no-such-dtype", "not a NumPy dtype"),
])
def test_setup_rejects(shape, dtype, message):
    t = T.StagedMPI(MPI.COMM_SELF)
    with pytest.raises(ValueError, match=f"rank 0: .*{message}"):
        t.setup(shape, dtype)
    assert not t.is_setup


def test_host_validation():
    t = T.HostMPI(MPI.COMM_SELF).setup(SHAPE, np.int64)
    send, recv = np.zeros(SHAPE, np.int64), np.zeros((1,) + SHAPE, np.int64)
    cases = [
        ((np.zeros((2, 3, 5), np.int64), recv), ValueError, r"send: shape \(2, 3, 5\)"),
        ((send.astype(np.int32), recv), TypeError, "send: dtype int32"),
        ((np.zeros((2, 6, 4), np.int64)[:, ::2], recv), ValueError, "send: must be C-contiguous"),
        ((send, np.zeros(SHAPE, np.int64)), ValueError, r"recv: shape .*\(comm.size, \*shape\)"),
        ((send, recv.astype(np.float64)), TypeError, "recv: dtype float64"),
        ((send.tolist(), recv), TypeError, "send: expected a NumPy array"),
        ((_device_array(send), recv), TypeError, "send: a device array"),
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


@pytest.mark.parametrize("cls", [T.StagedMPI, T.DeviceMPI, T.IPCAllGather],
                         ids=lambda c: c.name)
def test_device_validation(cls):
    if not _device_ok(cls):
        pytest.skip("this MPI cannot read device memory")
    t = cls(MPI.COMM_SELF).setup(SHAPE, np.float16)
    send = _device_array(np.ones(SHAPE, np.float16))
    recv = _device_array(np.zeros((1,) + SHAPE, np.float16))
    wide = _device_array(np.zeros((2, 3, 8), np.float16))
    cases = [
        ((np.ones(SHAPE, np.float16), recv), TypeError, "send: a host NumPy array"),
        ((send, np.zeros((1,) + SHAPE, np.float16)), TypeError, "recv: a host NumPy array"),
        ((_device_array(np.ones(SHAPE, np.float32)), recv), TypeError, "send: dtype float32"),
        ((send, _device_array(np.zeros((2,) + SHAPE, np.float16))), ValueError, "recv: shape"),
        ((wide[:, :, ::2], recv), ValueError, "send: must be C-contiguous"),
        ((object(), recv), TypeError, "send"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            t.all_gather(*args)
    t.teardown()


# ---------------------------------------------------------------------------
# Many ranks, under mpiexec


def run_ranks(mpiexec, n, tmp_path, *args, env=None):
    """``mpiexec -n n allgather_check.py --size n *args``; returns (status, lines by rank)."""
    out_dir = tmp_path / f"ranks-{n}"
    out_dir.mkdir()
    environment = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    environment.update(NUMBA_CP_BACKEND="sim", PYTHONUNBUFFERED="1", **(env or {}))
    command = [*mpiexec, "-n", str(n), sys.executable, str(SCRIPT), "--size", str(n),
               "--out-dir", str(out_dir), *args]
    returncode, output = run_mpiexec(command, env=environment, cwd=ROOT)
    lines = {}
    for path in sorted(out_dir.iterdir()):
        text = path.read_text().splitlines()
        assert text, f"{path.name} is empty; output:\n{output[-4000:]}"
        rank = int(text[0].split()[0].removeprefix("rank="))
        assert rank not in lines, f"two processes claim rank {rank}:\n{output[-4000:]}"
        lines[rank] = text
    assert sorted(lines) == list(range(n)), f"ranks {sorted(lines)} reported:\n{output[-4000:]}"
    for rank, text in lines.items():
        assert text[0] == f"rank={rank} size={n}", f"{text[0]!r}:\n{output[-4000:]}"
    return returncode, lines, output


def _oks(text):
    return [line.split(" ", 2)[2] for line in text if line.split()[1] == "OK"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_gather_values(mpiexec, tmp_path, n):
    status, lines, output = run_ranks(mpiexec, n, tmp_path)
    assert status == 0, output[-4000:]
    expected = sorted(f"transport={name} asked={name} dtype={dtype} round={r}"
                      for name in ("host", "staged", "mpi-device") for dtype in DTYPES
                      for r in range(ROUNDS))
    for rank, text in lines.items():
        assert not [line for line in text if " FAIL " in line or " ERROR " in line], text
        assert sorted(_oks(text)) == expected, f"rank {rank}:\n" + "\n".join(text)


@pytest.mark.parametrize("n, what", [(2, "shape"), (3, "dtype")])
def test_mismatched_setup_fails_on_every_rank(mpiexec, tmp_path, n, what):
    status, lines, output = run_ranks(mpiexec, n, tmp_path, "--case", "mismatch", "--what", what,
                                      "--transports", "staged")
    assert status != 0, output[-4000:]
    odd = ", ".join(str(r) for r in range(1, n, 2))
    even = ", ".join(str(r) for r in range(0, n, 2))
    variant = "shape (2, 4, 4) dtype int64" if what == "shape" else "shape (2, 3, 4) dtype float16"
    for rank, text in lines.items():
        errors = [line for line in text if " ERROR " in line]
        assert len(errors) == 1, f"rank {rank}: {text}"
        assert "ValueError: staged setup: ranks disagree" in errors[0]
        assert f"shape (2, 3, 4) dtype int64 on rank(s) {even}" in errors[0]
        assert f"{variant} on rank(s) {odd}" in errors[0]
        assert not _oks(text)


@pytest.mark.parametrize("env, asked, expected", [
    ({}, "auto", "staged"),
    ({T.GPU_AWARE_ENV: "1"}, "auto", "mpi-device"),
    ({T.TRANSPORT_ENV: "mpi-device", T.GPU_AWARE_ENV: "0"}, "auto", "mpi-device"),
    ({T.TRANSPORT_ENV: "host"}, "auto-host", "host"),
], ids=["sim-default", "gpu-aware-env", "forced-env", "forced-host"])
def test_choice_under_mpiexec(mpiexec, tmp_path, env, asked, expected):
    status, lines, output = run_ranks(mpiexec, 2, tmp_path, "--transports", asked, env=env)
    assert status == 0, output[-4000:]
    want = sorted(f"transport={expected} asked={asked} dtype={dtype} round={r}"
                  for dtype in DTYPES for r in range(ROUNDS))
    for rank, text in lines.items():
        assert sorted(_oks(text)) == want, f"rank {rank}:\n" + "\n".join(text)


def test_unknown_transport_env_under_mpiexec(mpiexec, tmp_path):
    status, lines, output = run_ranks(mpiexec, 2, tmp_path, "--case", "choose",
                                      env={T.TRANSPORT_ENV: "bogus"})
    assert status != 0, output[-4000:]
    for rank, text in lines.items():
        assert text[1:] == [f"rank={rank} ERROR ValueError: {T.TRANSPORT_ENV}='bogus': unknown "
                            "transport; choose one of host, ipc, mpi-device, nccl, staged"], text
