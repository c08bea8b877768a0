import os

# Tests run on the CPU simulator unless a GPU target is asked for explicitly
# (NUMBA_CP_BACKEND=cuda runs the same tests on CuPy arrays).
os.environ.setdefault("NUMBA_CP_BACKEND", "sim")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from support import find_mpiexec  # noqa: E402

settings.register_profile(
    "numba_cp", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "numba_cp"))


@pytest.fixture(scope="session")
def mpiexec():
    """The mpiexec command line multi-rank tests launch with (skips if there is none)."""
    command = find_mpiexec()
    if command is None:
        pytest.skip("no mpiexec beside sys.executable or on PATH")
    return command
