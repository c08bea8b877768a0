"""The time limits a GPU run gives each test must end a test whose main thread never
gets to handle a signal, as one waiting in C on a kernel that never returns: the thread
method (support.thread_timeouts) where the wait lets go of the GIL (here, a sleep with
SIGALRM blocked), and faulthandler's watchdog (support.last_resort_limit) where it keeps
the GIL (here, a sleep called through ctypes.PyDLL)."""

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent

STUCK = """
import signal, time
import pytest

@pytest.mark.timeout(2)
def test_stuck_with_its_own_limit():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(60)
"""

HOLDING_THE_GIL = """
import ctypes
import pytest

@pytest.mark.timeout(2)
def test_stuck_holding_the_gil():
    ctypes.PyDLL(None).sleep(60)  # a C call that keeps the GIL while it waits
"""

CONFTEST = """
from support import thread_timeouts

def pytest_collection_modifyitems(config, items):
    thread_timeouts(items)
"""

# The GPU runs' conftest: the thread method and the last resort, here after 1 s more.
CONFTEST_WITH_LAST_RESORT = CONFTEST + """
import pytest
import support
from support import keep_stderr, last_resort_limit

support.LAST_RESORT_GRACE = 1

def pytest_configure(config):
    keep_stderr()

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with last_resort_limit(item):
        yield
"""


def run_stuck_test(folder, with_helper, patience, test=STUCK, conftest=CONFTEST):
    (folder / "test_stuck.py").write_text(test)
    (folder / "conftest.py").write_text(conftest if with_helper else "")
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "--rootdir", str(folder), "-c", os.devnull,
                               str(folder / "test_stuck.py")],
                              cwd=folder, env=env, capture_output=True, text=True,
                              timeout=patience)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start
    return proc, time.monotonic() - start


def test_thread_timeouts_end_a_test_that_cannot_take_a_signal(tmp_path):
    proc, seconds = run_stuck_test(tmp_path, with_helper=True, patience=30)
    assert proc is not None, f"the stuck test outlived its 2 s limit by {seconds - 2:.0f} s"
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "+ Timeout +" in output, output
    # the stuck thread's stack, down to the line it waits in
    assert 'test_stuck.py", line 8, in test_stuck_with_its_own_limit' in output, output


def test_without_them_the_same_test_outlives_its_limit(tmp_path):
    """What the helper is for: with pytest-timeout's default method the test runs past
    its 2 s limit (here to 8 s, when the subprocess is killed)."""
    proc, seconds = run_stuck_test(tmp_path, with_helper=False, patience=8)
    assert proc is None, (proc.stdout + proc.stderr, seconds)


def test_a_test_that_holds_the_gil_is_ended_by_the_last_resort(tmp_path):
    """A C call that keeps the GIL also stops pytest-timeout's thread; faulthandler's
    watchdog, which needs no GIL, dumps the stacks and ends the run at 2 + 1 s."""
    proc, seconds = run_stuck_test(tmp_path, with_helper=True, patience=30,
                                   test=HOLDING_THE_GIL, conftest=CONFTEST_WITH_LAST_RESORT)
    assert proc is not None, f"the stuck test outlived its limit by {seconds - 3:.0f} s"
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert seconds < 20, f"ended after {seconds:.0f} s, not by the last resort"
    assert "Timeout (0:00:03)!" in output, output  # faulthandler's own header
    assert 'test_stuck.py", line 7 in test_stuck_holding_the_gil' in output, output
