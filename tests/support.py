"""Test helpers: arrays on the active backend's memory, launch tunings, random exchange
cases (from numba_cp.testing), the mpiexec runner, and time limits a GPU run keeps."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from numba_cp.arrays import device_copy, host_copy
from numba_cp.backend import TARGET
from numba_cp.testing import (ExchangeCase, exchange_cases, score_matrix,  # noqa: F401
                              seq_len_choices)

to_device = device_copy
to_host = host_copy

# Threads per block small enough for the simulator, but not one (races need >1).
THREADS = 4 if TARGET.simulator else 128


def kernel_examples(n):
    """``settings`` of a hypothesis test that launches kernels: ``n`` examples under the
    simulator, a quarter of them (at least 5) on a GPU. There every drawn launch shape
    compiles a kernel of its own: on an H100, one such test of 30 examples took
    minutes."""
    return settings(max_examples=n if TARGET.simulator else max(5, n // 4))


def thread_timeouts(items):
    """Give each test's time limit (its own, else the configured one) pytest-timeout's
    thread method: at the limit it dumps every thread's stack and ends the run. The
    default, a signal, is handled only between Python bytecodes; a call waiting in C on
    a GPU kernel that never returns would let the limit pass unnoticed and hang."""
    for item in items:
        item.add_marker(pytest.mark.timeout(_own_limit(item), method="thread"),
                        append=False)


def _own_limit(item):
    own = item.get_closest_marker("timeout")
    return own.kwargs.get("timeout", own.args[0] if own.args else None) if own else None


# Seconds past a test's limit at which the last resort below ends the process.
LAST_RESORT_GRACE = 30
_STDERR = []  # a copy of the terminal's stderr, taken before pytest captures output


def keep_stderr():
    """Copy stderr's descriptor for :func:`last_resort_limit`; call it from
    ``pytest_configure``, where pytest is not capturing output (while a test runs,
    descriptor 2 writes into a capture file that a process ended from C never shows)."""
    import os

    if not _STDERR:
        _STDERR.append(os.dup(2))


@contextlib.contextmanager
def last_resort_limit(item):
    """While ``item`` runs: at its time limit plus :data:`LAST_RESORT_GRACE`, dump every
    thread's stack and end the process, from faulthandler's watchdog thread.

    pytest-timeout's thread method runs in a Python thread, so it needs the GIL. A call
    that waits in C holding the GIL (a ``ctypes.PyDLL`` function, a binding that keeps
    it over a blocking driver call) leaves that thread waiting too, and the limit passes
    unnoticed. faulthandler's watchdog is a C thread, which needs no GIL.
    """
    import faulthandler

    seconds = _own_limit(item)
    if seconds is None:  # pytest-timeout's --timeout, else its ini setting
        seconds = float(item.config.getoption("timeout", None)
                        or item.config.getini("timeout") or 0)
    if not seconds:
        yield
        return
    faulthandler.dump_traceback_later(seconds + LAST_RESORT_GRACE, exit=True,
                                      file=_STDERR[0] if _STDERR else 2)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def launches():
    """Launch tuning for either kernel family: results must not depend on it.

    ``"warp"``: one, two or four warps per row and short, default or long
    passes; ``"rank"``: one to four warps per row (so one to many keys per
    thread) and chunks from one run to the whole row; ``"radix"``: odd and
    small blocks, and tiny sort tiles that force the radix passes.
    """
    lanes = TARGET.lanes
    warp = st.fixed_dictionaries(dict(
        method=st.just("warp"),
        threads=st.sampled_from([None, lanes, 2 * lanes, 4 * lanes]),
        sort_limit=st.sampled_from([None, 1, 4 * lanes])))
    rank = st.fixed_dictionaries(dict(
        method=st.just("rank"),
        threads=st.sampled_from([None, lanes, 2 * lanes, 4 * lanes]),
        sort_limit=st.sampled_from([None, 1, 2 * lanes, 1 << 11])))
    radix = st.fixed_dictionaries(dict(
        method=st.just("radix"), threads=st.sampled_from([1, 3, THREADS]),
        sort_limit=st.sampled_from([None, 1, 5])))
    return st.one_of(warp, rank, radix, st.just(dict(method="auto")))


@contextlib.contextmanager
def planned_kernels(cache):
    """``ops``' launch cache ``cache`` (``"_PACK_LAUNCHES"``, ``"_MERGE_LAUNCHES"``)
    emptied while inside; yields a list that holds, on exit, the names of the kernels
    the calls inside planned."""
    from numba_cp import _numba, launcher, ops

    saved, names = getattr(ops, cache), []
    setattr(ops, cache, launcher.LaunchCache())
    try:
        yield names
        names.extend(_numba.kernel_py_func(launch.kernel).__name__
                     for launch in getattr(ops, cache).values())
    finally:
        setattr(ops, cache, saved)


# The case strategy and its pieces are public, for people testing their own
# kernels; the short names are what these tests have always used.
Case = ExchangeCase
cases = exchange_cases


# -- running ranks under mpiexec ---------------------------------------------------

MPI_TIMEOUT_S = 120


def find_mpiexec():
    """``[mpiexec, flags...]``: the one beside sys.executable (a venv's, matching its MPI
    wheel), else the first on PATH; None if there is none.

    ``NUMBA_CP_MPIEXEC_FLAGS`` adds launcher flags (e.g. ``-launcher fork``).
    """
    import os
    import shlex
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        return None
    flags = shlex.split(os.environ.get("NUMBA_CP_MPIEXEC_FLAGS", ""))
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        flags.append("--oversubscribe")  # 4 ranks on a 2-core machine
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [found, *flags]


def run_mpiexec(command, *, env, cwd, timeout=MPI_TIMEOUT_S):
    """Run an mpiexec command line; kill it and every rank it started if it outlives
    ``timeout``. Returns ``(returncode, combined output)``; a hang fails the test."""
    import os
    import signal
    import subprocess

    import pytest

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=str(cwd), start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(map(str, command[:4]))} ... hung for {timeout} s:\n"
                    f"{output[-4000:]}")
    return process.returncode, output
