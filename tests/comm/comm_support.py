"""Helpers of the transport tests: a fake communicator, payloads, and the mpiexec runner.

The multi-rank tests run scripts from ``mpi_scripts/`` under ``mpiexec -n N``.
The mpiexec is the one beside ``sys.executable`` (a virtualenv's, matching its
MPI wheel), else the first on PATH; ``NUMBA_CP_MPIEXEC_FLAGS`` adds launcher
flags (e.g. ``-launcher fork``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np

from numba_cp.comm import GPU_AWARE_ENV, TRANSPORT_ENV
from numba_cp.comm.ipc import TIMEOUT_ENV as IPC_TIMEOUT_ENV
from numba_cp.comm.base import TIMEOUT_ENV
from support import run_mpiexec

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
# What the transports read from the environment; every test starts without them.
ENV_VARS = (TRANSPORT_ENV, GPU_AWARE_ENV, IPC_TIMEOUT_ENV, TIMEOUT_ENV, "NUMBA_CP_IPC_WAIT",
            "NUMBA_CP_NODES",
            "MPICH_GPU_SUPPORT_ENABLED")


class FakeComm:
    """A communicator of ``size`` ranks seen from ``rank``: collectives answer for all.

    ``others(call, rank, value)`` gives rank ``rank``'s contribution to the
    ``call``-th allgather (default: the same as ours). ``shared``: whether
    ``Split_type`` finds every rank on this node.
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
        index = self.calls.count("allgather")
        self.calls.append("allgather")
        return [value if r == self.rank else self.others(index, r, value)
                for r in range(self.size)]

    def Barrier(self):
        self.calls.append("Barrier")

    def Split_type(self, kind):
        self.calls.append("Split_type")
        size = self.size if self.shared else 1
        return types.SimpleNamespace(Get_size=lambda: size, Free=lambda: None)


def load_script_module(name):
    """A fresh copy of ``mpi_scripts/<name>.py`` as a module (its globals are its own)."""
    spec = importlib.util.spec_from_file_location(f"_{name}_for_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def payload(rank, round_, shape, dtype):
    """Rank- and round-specific bytes of ``shape``/``dtype``: every bit pattern, NaNs too."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    rng = np.random.default_rng([rank, round_, n])
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(dtype).reshape(shape)


def script_env(backend="sim", **extra):
    """The environment of a rank: none of the transport variables, unbuffered output,
    the scripts' folder on PYTHONPATH (a script may import a sibling)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    path = [str(SCRIPTS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(NUMBA_CP_BACKEND=backend, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path))
    if backend != "sim":
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(extra)
    return env


def run_ranks(mpiexec, n, out_dir, script, *args, env=None, backend="sim", timeout=None):
    """``mpiexec -n n <script> --size n --out-dir out_dir *args``.

    For scripts that write each rank's lines to a file of their own (first line
    ``rank=R size=N``). Returns ``(status, {rank: lines}, combined output)``;
    fails the test unless exactly ranks ``0..n-1`` reported, each with size ``n``
    (a launcher/library mismatch runs N singletons of size 1).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    command = [*mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / script), "--size", str(n),
               "--out-dir", str(out_dir), *args]
    options = {} if timeout is None else {"timeout": timeout}
    status, output = run_mpiexec(command, env=script_env(backend, **(env or {})), cwd=ROOT,
                                 **options)
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
    return status, lines, output


def oks(text):
    """The labels of a rank's ``OK`` lines."""
    return [line.split(" ", 2)[2] for line in text if line.split()[1:2] == ["OK"]]


def problems(text):
    """A rank's ``FAIL`` and ``ERROR`` lines."""
    return [line for line in text if line.split()[1:2] in (["FAIL"], ["ERROR"])]
