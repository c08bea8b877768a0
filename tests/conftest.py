import os
from functools import lru_cache

# Tests run on the CPU simulator unless a GPU target is asked for explicitly
# (NUMBA_CP_BACKEND=cuda runs the same tests on CuPy arrays).
os.environ.setdefault("NUMBA_CP_BACKEND", "sim")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from support import find_mpiexec, keep_stderr, last_resort_limit, thread_timeouts  # noqa: E402

settings.register_profile(
    "numba_cp", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "numba_cp"))


def pytest_configure(config):
    keep_stderr()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """On a GPU target, a last resort past each test's limit (support.last_resort_limit)."""
    from numba_cp.backend import TARGET

    if TARGET.simulator:
        yield
        return
    with last_resort_limit(item):
        yield


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests under the simulator; insist that mpiexec users say ``mpi``.

    ``-m "not mpi"`` is only trustworthy if every test that launches ranks
    carries the marker, so a test asking for the ``mpiexec`` fixture without it
    is a collection error rather than a silent slow test.
    """
    from numba_cp.backend import TARGET

    unmarked = [item.nodeid for item in items
                if "mpiexec" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("mpi") is None]
    if unmarked:
        raise pytest.UsageError("tests that use the mpiexec fixture must be marked "
                                "@pytest.mark.mpi: " + ", ".join(unmarked))
    if not TARGET.simulator:
        thread_timeouts(items)
        return
    skip = pytest.mark.skip(reason="needs a GPU target (NUMBA_CP_BACKEND=cuda or hip); "
                                   "the simulator is active")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@lru_cache(maxsize=None)
def _mpiexec_command():
    return find_mpiexec()  # looked up once for the whole test run


@pytest.fixture
def mpiexec():
    """The mpiexec command line multi-rank tests launch with (skips if there is none)."""
    command = _mpiexec_command()
    if command is None:
        pytest.skip("no mpiexec beside sys.executable or on PATH")
    return command
