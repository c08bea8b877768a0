"""The time limit a GPU run gives each test (support.thread_timeouts) must end a test
whose main thread never gets to handle a signal, as one waiting in C on a kernel that
never returns. Here the stand-in for that kernel is a sleep with SIGALRM blocked."""

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

CONFTEST = """
from support import thread_timeouts

def pytest_collection_modifyitems(config, items):
    thread_timeouts(items)
"""


def run_stuck_test(folder, with_helper, patience):
    (folder / "test_stuck.py").write_text(STUCK)
    (folder / "conftest.py").write_text(CONFTEST if with_helper else "")
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
