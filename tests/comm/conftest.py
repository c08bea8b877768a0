import pytest

from comm_support import ENV_VARS
from numba_cp.comm import gpu_aware


@pytest.fixture(autouse=True)
def _clean_transport_env(monkeypatch):
    """No test sees the caller's transport settings, or a library answer cached by another."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    gpu_aware._probe_loaded_library.cache_clear()
    yield
    gpu_aware._probe_loaded_library.cache_clear()
