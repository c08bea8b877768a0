"""The transport interface, its registry, and the one rank-agreement helper.

A transport all-gathers bytes over an mpi4py communicator: each rank's
``send`` becomes ``recv[rank]`` on every rank, written into a caller-owned
buffer (``docs/SPEC.md``, "The all-gather"). Only bytes move, so any
plain-data dtype works (for bf16 pass a ``uint16`` view).

Every transport has the same life cycle::

    t = choose_transport(comm, device=True)    # or StagedMPI(comm), ...
    t.setup((heads, max_tokens, topk), np.int64)  # collective: every rank calls it
    t.all_gather(send, recv, stream=None)       # collective; returns recv
    t.teardown()

:meth:`Transport.setup` sizes the buffers once for the largest payload; a call
may then send any C-contiguous array of that dtype and at most that many bytes
(``recv`` of shape ``(world, *send.shape)``), so one transport serves every
token count up to the plan's ``max_tokens``. Setup checks with one tiny
``allgather`` that every rank asked for the same shape and dtype and raises
the same :class:`~numba_cp.errors.RankAgreementError` on every rank otherwise.
The per-call checks are local and raise before any communication.
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np

from ..arrays import as_kernel_array, byte_range
from ..backend import TARGET
from ..errors import CollectiveTimeoutError, RankAgreementError

__all__ = ["Transport", "TRANSPORTS", "register_transport", "agree", "describe_problem",
           "mpi", "collective_timeout", "wait_for", "allgather_objects", "barrier",
           "TIMEOUT_ENV"]

TIMEOUT_ENV = "NUMBA_CP_TIMEOUT"
# The longest a host-side collective may wait for its peers. Ranks reach a
# collective apart by their skew, which is microseconds in steady state but can
# be a first call's kernel compilation: seconds on a GPU, tens of seconds on
# the simulator, whose ranks may share few cores.
DEFAULT_TIMEOUT_S = 300.0 if TARGET.simulator else 60.0


SPIN_S = 1e-3  # poll without sleeping this long: a sleep costs ~60 us of latency


def mpi():
    """``mpi4py.MPI``, imported on first use: only the transports need it."""
    from mpi4py import MPI

    return MPI


def seconds_from_env(var: str, default: float) -> float:
    """A positive number of seconds from environment variable ``var``, else ``default``."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{var}={raw!r}: expected a positive number of seconds")
    return value


def collective_timeout() -> float:
    """Seconds a collective waits for its peers: ``NUMBA_CP_TIMEOUT``, else the default."""
    return seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def wait_for(comm, request, what: str):
    """Complete a nonblocking MPI ``request``, or raise CollectiveTimeoutError.

    Polls with short sleeps, so a rank waiting for a slow peer leaves the
    cores to ranks that share them.
    """
    if request.Test():
        return
    timeout = collective_timeout()
    start = time.monotonic()
    while not request.Test():
        waited = time.monotonic() - start
        if waited > SPIN_S:  # past the steady-state skew: give the cores away
            time.sleep(min(1e-3, waited / 8))
        if waited > timeout:
            raise CollectiveTimeoutError(
                f"{what}: rank {comm.Get_rank()} waited {waited:.1f} s for the other ranks "
                f"of {comm.Get_size()}; a rank failed or made a different number of calls "
                f"({TIMEOUT_ENV}={timeout:g} s)")


def allgather_objects(comm, obj, what: str) -> list:
    """``comm.allgather(obj)`` with a bounded wait (two nonblocking collectives).

    A communicator without nonblocking collectives (a stand-in) is asked with
    its own ``allgather``.
    """
    if not hasattr(comm, "Iallgatherv"):
        return comm.allgather(obj)
    MPI = mpi()
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.zeros(comm.Get_size(), np.int64)
    wait_for(comm, comm.Iallgather(np.array([data.size], np.int64), sizes), what)
    gathered = np.empty(int(sizes.sum()), np.uint8)
    displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    wait_for(comm, comm.Iallgatherv(data, [gathered, sizes, displacements, MPI.BYTE]), what)
    return [pickle.loads(gathered[d:d + n].tobytes()) for d, n in zip(displacements, sizes)]


def barrier(comm, what: str):
    """``comm.Barrier()`` with a bounded wait (a stand-in communicator's own Barrier)."""
    if not hasattr(comm, "Ibarrier"):
        return comm.Barrier()
    wait_for(comm, comm.Ibarrier(), what)


def describe_problem(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def agree(comm, what: str, *, problem: str | None = None, values: dict | None = None,
          payload=None, cleanup=None) -> list:
    """One ``allgather`` that makes every rank raise the same error, or none.

    ``problem``: why this rank cannot go on (None if it can). ``values``:
    ``{name: value}`` that must be equal on every rank. ``payload``: anything
    to share. If any rank has a problem or any value differs, ``cleanup()``
    runs and every rank raises :class:`RankAgreementError` naming ``what``,
    the ranks and the fields. Otherwise returns every rank's ``payload``.
    """
    everyone = allgather_objects(comm, (problem, values or {}, payload), what)
    failures = [(rank, p) for rank, (p, _, _) in enumerate(everyone) if p]
    message = ""
    if failures:
        message = "; ".join(f"rank {rank}: {p}" for rank, p in failures)
    else:
        for name in everyone[0][1]:
            seen: dict = {}
            for rank, (_, v, _) in enumerate(everyone):
                seen.setdefault(repr(v.get(name)), []).append(rank)
            if len(seen) > 1:
                message = f"ranks disagree on {name}: " + "; ".join(
                    f"{value} on rank(s) {_ranks(ranks)}" for value, ranks in seen.items())
                break
    if message:
        if cleanup is not None:
            cleanup()
        raise RankAgreementError(f"{what}: {message}")
    return [p for _, _, p in everyone]


def _shape_problem(shape):
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        return None, f"shape {shape!r} is not a tuple of integers"
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in dims):
        return None, f"shape {shape!r} is not a tuple of integers"
    dims = tuple(int(n) for n in dims)
    if any(n < 0 for n in dims):
        return None, f"shape {dims} has a negative extent"
    return dims, None


def _dtype_problem(dtype):
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        return None, f"dtype {dtype!r} is not a NumPy dtype ({exc})"
    if dtype.hasobject:
        return None, f"dtype {dtype} holds Python objects; only plain-data dtypes move as bytes"
    return dtype, None


def check_apart(send_range, recv_range):
    """Raise unless the byte ranges ``(address, nbytes)`` of send and recv are disjoint."""
    (s0, sn), (r0, rn) = send_range, recv_range
    if sn and rn and s0 < r0 + rn and r0 < s0 + sn:
        raise ValueError("recv: overlaps send; the all-gather is not done in place")


class Transport:
    """The life cycle shared by all transports: setup, all_gather, teardown.

    ``device``: whether it takes device arrays (True) or host NumPy arrays.
    ``capturable``: whether :meth:`all_gather` only queues device work on the
    stream, so that a CUDA/HIP graph can capture it (MPI calls block the host).
    ``delivers``: whether the pack and merge kernels can do the gather
    themselves (the fused IPC exchange): then it has a ``delivery()``.
    Subclasses implement ``_setup``, ``_teardown`` and ``_all_gather``.
    """

    name = ""
    device = False
    capturable = False
    delivers = False

    def __init__(self, comm):
        self.comm = comm
        self.reason = ""  # why choose_transport picked it, for logs
        self.shape = None
        self.dtype = None
        self.nbytes = 0  # the most bytes one rank sends

    @property
    def is_setup(self) -> bool:
        return self.shape is not None

    def setup(self, shape, dtype):
        """Size the buffers for sends of up to ``shape``/``dtype``; collective over ``comm``.

        Raises :class:`RankAgreementError` on every rank if any rank's
        ``shape`` or ``dtype`` is invalid or differs from another rank's.
        Returns ``self``.
        """
        if self.is_setup:
            raise RuntimeError(f"{self.name}: already set up; call teardown() first")
        dims, problem = _shape_problem(shape)
        dtype, dtype_problem = _dtype_problem(dtype)
        agree(self.comm, f"{self.name} setup", problem=problem or dtype_problem,
              values={"the transport": self.name,
                      "the all-gather buffer (every rank must set up the same shape and "
                      "dtype)": (dims, None if dtype is None else dtype.str)})
        self.shape = dims
        self.dtype = dtype
        self.nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        try:
            self._setup()
        except BaseException:
            self.shape = self.dtype = None
            self.nbytes = 0
            raise
        return self

    def teardown(self, *, collective: bool = True):
        """Release what :meth:`setup` took; safe to call twice.

        Collective by default: every rank waits (bounded) until all are done
        with the buffers, since peers may still write into a rank's memory.
        ``collective=False`` releases at once, for a rank that is failing.
        """
        if self.is_setup:
            try:
                if collective:
                    barrier(self.comm, f"{self.name} teardown")
                self._teardown()
            finally:
                self.shape = self.dtype = None
                self.nbytes = 0

    def all_gather(self, send, recv, stream=None):
        """Gather every rank's ``send`` into ``recv[rank]`` on all ranks; returns ``recv``.

        ``send``: C-contiguous, the dtype given to :meth:`setup`, at most its
        bytes; ``recv``: shape ``(comm.size, *send.shape)``, the same dtype,
        C-contiguous, not overlapping ``send``. Every rank sends the same
        shape. ``stream`` is the stream that produced ``send`` and will consume
        ``recv`` (device transports; see :func:`numba_cp.arrays.resolve_stream`).
        """
        if not self.is_setup:
            raise RuntimeError(f"{self.name}: call setup(shape, dtype) before all_gather")
        return self._all_gather(send, recv, stream)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        self.teardown(collective=kind is None)  # a failing rank must not wait for peers
        return False

    def __repr__(self):
        state = (f"shape={self.shape}, dtype={self.dtype}" if self.is_setup else "not set up")
        return f"<{type(self).__name__} {self.name!r} size={self.comm.Get_size()} {state}>"

    # -- checks shared by the subclasses -------------------------------------

    def _check_pair(self, send, recv):
        """Validate ``send``/``recv`` (shapes, dtypes, layout, overlap); returns
        their byte ranges ``((address, nbytes), (address, nbytes))``."""
        world = self.comm.Get_size()
        for name, array in (("send", send), ("recv", recv)):
            if np.dtype(array.dtype) != self.dtype:
                raise TypeError(f"{name}: dtype {np.dtype(array.dtype)} but the {self.name} "
                                f"transport was set up for {self.dtype}")
        send_range, recv_range = byte_range(send, "send"), byte_range(recv, "recv")
        if send_range[1] > self.nbytes:
            raise ValueError(f"send: shape {tuple(send.shape)} is {send_range[1]} bytes, more "
                             f"than the {self.nbytes} the {self.name} transport was set up for "
                             f"(shape {self.shape})")
        want = (world,) + tuple(send.shape)
        if tuple(recv.shape) != want:
            raise ValueError(f"recv: shape {tuple(recv.shape)}, expected {want} "
                             "(comm.size, *send.shape)")
        check_apart(send_range, recv_range)
        return send_range, recv_range

    def _host_pair(self, send, recv):
        for name, array in (("send", send), ("recv", recv)):
            if not isinstance(array, np.ndarray):
                if hasattr(array, "__cuda_array_interface__") or getattr(
                        array, "__cuda_ndarray__", False):
                    raise TypeError(f"{name}: a device array was given to the {self.name} "
                                    "transport, which takes host NumPy arrays")
                raise TypeError(f"{name}: expected a NumPy array, got {type(array).__name__}")
        if not recv.flags.writeable:
            raise ValueError("recv: is read-only")
        return self._check_pair(send, recv)

    def _device_pair(self, send, recv):
        """Numba device-array views of ``send``/``recv`` (the simulator's there), validated."""
        views = []
        for name, array in (("send", send), ("recv", recv)):
            if isinstance(array, np.ndarray):
                raise TypeError(f"{name}: a host NumPy array was given to the {self.name} "
                                "transport, which takes device arrays")
            if TARGET.simulator:
                if not getattr(array, "__cuda_ndarray__", False):
                    raise TypeError(f"{name}: expected a simulator device array "
                                    f"(numba.cuda.to_device), got {type(array).__name__}")
                views.append(array)
            else:
                views.append(as_kernel_array(array, name).arg)
        ranges = self._check_pair(*views)
        return views, ranges

    # -- subclass hooks -------------------------------------------------------

    def _setup(self):
        pass

    def _teardown(self):
        pass

    def _all_gather(self, send, recv, stream):
        raise NotImplementedError


TRANSPORTS: dict[str, type[Transport]] = {}


def register_transport(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make ``cls`` choosable by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a transport needs a name")
    if TRANSPORTS.get(cls.name, cls) is not cls:
        raise ValueError(f"transport name {cls.name!r} is taken by "
                         f"{TRANSPORTS[cls.name].__name__}")
    TRANSPORTS[cls.name] = cls
    return cls
