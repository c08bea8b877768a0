import os

# Tests run on the CPU simulator unless a GPU target is asked for explicitly
# (NUMBA_CP_BACKEND=cuda runs the same tests on CuPy arrays).
os.environ.setdefault("NUMBA_CP_BACKEND", "sim")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "numba_cp", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "numba_cp"))
