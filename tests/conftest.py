import os
import sys

# Tests run on the CPU simulator unless a GPU target is asked for explicitly
# (NUMBA_CP_BACKEND=cuda runs the same tests on CuPy arrays).
os.environ.setdefault("NUMBA_CP_BACKEND", "sim")

# The simulator's scheduler busy-polls its Python threads under the GIL; a short
# switch interval makes simulated blocks 5-7x faster.
sys.setswitchinterval(5e-5)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "numba_cp", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "numba_cp"))
