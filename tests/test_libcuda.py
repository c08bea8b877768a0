"""numba_cp._libcuda: libcuda's launch and context calls with their types declared once.

The calls themselves run on NVIDIA GPUs only (test_launch_cache.py); here a stand-in
library checks what is declared and how a context handle or a failure comes back.
"""

import ctypes

import pytest

from numba_cp import _libcuda


class _Function:
    """A stand-in for a ctypes foreign function: takes declared types, records calls."""

    def __init__(self, body):
        self.body = body
        self.calls = []
        self.restype = self.argtypes = None

    def __call__(self, *args):
        self.calls.append(args)
        return self.body(*args)


def _write_context(value, status=0):
    def current(reference):
        reference._obj.value = value  # the c_void_p that byref() points at
        return status

    return current


def _library(context=0x7F00_1234, status=0):
    library = type("Library", (), {})()
    library.cuLaunchKernel = _Function(lambda *args: 0)
    library.cuLaunchKernel_ptsz = _Function(lambda *args: 0)
    library.cuCtxGetCurrent = _Function(_write_context(context, status))
    return library


def test_the_launch_is_declared_as_the_driver_api_gives_it():
    library = _library()
    _libcuda.Driver(library)
    launch = library.cuLaunchKernel
    assert launch.restype is ctypes.c_int  # CUresult
    # f, three grid and three block dimensions, shared bytes, stream, params, extra
    assert launch.argtypes == ([ctypes.c_void_p] + [ctypes.c_uint] * 7
                               + [ctypes.c_void_p] * 3)


@pytest.mark.parametrize("setting,per_thread", [(None, False), ("0", False), ("", False),
                                                 ("1", True)])
def test_stream_0_means_what_it_means_to_cuda_bindings(monkeypatch, setting, per_thread):
    """CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM picks the _ptsz launch, as in
    cuda-bindings, so that stream 0 is the same stream for both."""
    if setting is None:
        monkeypatch.delenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", raising=False)
    else:
        monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", setting)
    library = _library()
    monkeypatch.setattr(_libcuda.ctypes, "CDLL", lambda name: library)
    _libcuda.driver.cache_clear()
    try:
        driver = _libcuda.driver()
    finally:
        _libcuda.driver.cache_clear()
    chosen = library.cuLaunchKernel_ptsz if per_thread else library.cuLaunchKernel
    assert driver.launch_kernel is chosen
    assert chosen.argtypes is not None


@pytest.mark.parametrize("context", [0x7F00_1234, 2**63 + 8])
def test_current_context_returns_the_handle_the_driver_writes(context):
    driver = _libcuda.Driver(_library(context))
    assert driver.current_context() == context


def test_no_current_context_is_zero():
    assert _libcuda.Driver(_library(None)).current_context() == 0


def test_a_failed_context_query_raises_with_the_status():
    driver = _libcuda.Driver(_library(status=201))  # CUDA_ERROR_INVALID_CONTEXT
    with pytest.raises(RuntimeError, match="cuCtxGetCurrent failed: CUresult 201"):
        driver.current_context()


def test_a_library_without_the_entry_points_is_no_driver(monkeypatch):
    monkeypatch.setattr(_libcuda.ctypes, "CDLL", lambda name: type("Empty", (), {})())
    _libcuda.driver.cache_clear()
    try:
        assert _libcuda.driver() is None
    finally:
        _libcuda.driver.cache_clear()


def test_no_library_is_no_driver(monkeypatch):
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(_libcuda.ctypes, "CDLL", refuse)
    _libcuda.driver.cache_clear()
    try:
        assert _libcuda.driver() is None
    finally:
        _libcuda.driver.cache_clear()
