"""Chained launches: every kernel may start before the kernel ahead of it ends.

On NVIDIA GPUs of compute capability 9.0 and newer the launcher starts a kernel
declared ``chained`` with CUDA's programmatic dependent launch, and the kernel's
first statement, ``chain_grids()``, waits there for the grid before it. A
chained kernel that touched memory before that wait could read a half-written
input, so the declaration and the first statement must agree in every kernel.
"""

import ast
import importlib.util
import os

import numpy as np
import pytest

import numba_cp
from numba_cp import _numba, launcher
from numba_cp import reference as ref
from numba_cp.backend import TARGET
from numba_cp.kernels import ipc, radix, rank, warp
from numba_cp.kernels.shells import KERNELS, SMALL_ROW_KERNELS

KERNELS_DIR = os.path.join(os.path.dirname(numba_cp.__file__), "kernels")


def _declared_kernels():
    """``(file, function, chained, first statement)`` of every ``@declare``d function."""
    found = []
    for name in sorted(os.listdir(KERNELS_DIR)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(KERNELS_DIR, name)).read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call)
                        and getattr(decorator.func, "id", "") == "declare"):
                    chained = any(k.arg == "chained" and getattr(k.value, "value", False)
                                  for k in decorator.keywords)
                    body = node.body
                    if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                            and isinstance(body[0].value.value, str)):
                        body = body[1:]  # a docstring
                    found.append((name, node.name, chained, body[0]))
    return found


def _is_chain_grids(statement):
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and getattr(statement.value.func, "id", "") == "chain_grids"
            and not statement.value.args)


def test_a_kernel_is_declared_chained_exactly_when_it_opens_with_chain_grids():
    kernels = _declared_kernels()
    assert len(kernels) >= 24, kernels  # ten per selection file, four IPC kernels
    for file, name, chained, first in kernels:
        assert chained == _is_chain_grids(first), (
            f"{file}:{name}: declared chained={chained} but its first statement is "
            f"{ast.unparse(first)!r}")
    unchained = [(file, name) for file, name, chained, _ in kernels if not chained]
    assert not unchained, f"every kernel follows another on its stream: {unchained}"


def test_nothing_else_calls_chain_grids():
    """The wait means nothing in a helper: a kernel that reached it late would
    already have touched memory."""
    declared = _declared_kernels()
    for name in sorted(os.listdir(KERNELS_DIR)):
        if not name.endswith(".py") or name == "primitives.py":
            continue
        tree = ast.parse(open(os.path.join(KERNELS_DIR, name)).read())
        calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
                 and getattr(c.func, "id", "") == "chain_grids"]
        # each chained kernel opens with it (the test above): any other call is extra
        kernels = sum(chained for file, _, chained, _ in declared if file == name)
        assert len(calls) == kernels, f"{name}: chain_grids() outside a chained kernel's top"


@pytest.mark.parametrize("family,shape", [(rank, (16, 2, 2 * TARGET.lanes, 16)),
                                          (warp, (16, 2, 1)), (radix, (64,))])
def test_every_factory_builds_a_chained_kernel(family, shape):
    """The declaration reaches the compiled kernel, which is what the launcher reads."""
    for factory in KERNELS + (() if family is radix else SMALL_ROW_KERNELS):
        kernel = getattr(family, factory)(*shape)
        assert _numba.kernel_py_func(kernel).chained is True, factory


def test_the_ipc_kernels_are_chained():
    for kernel in (ipc.ipc_bump_kernel, ipc.ipc_push_kernel, ipc.ipc_wait_copy_kernel,
                   ipc.ipc_wait_kernel):
        assert _numba.kernel_py_func(kernel).chained is True, kernel


def test_chaining_is_only_ever_on_where_the_gpu_can_chain():
    previous = launcher.set_chained_launches(True)
    try:
        on = launcher.chained_launches()
        if TARGET.name != "cuda":
            assert on is False
        assert launcher.set_chained_launches(False) == on
        assert launcher.chained_launches() is False
    finally:
        launcher.set_chained_launches(None)
    assert launcher.chained_launches() == (previous if TARGET.name == "cuda" else False)


@pytest.mark.skipif(importlib.util.find_spec("cuda.bindings") is None,
                    reason="cuda-bindings is not installed (an AMD-only environment)")
def test_chained_launch_config_asks_for_programmatic_stream_serialization():
    from cuda.bindings import driver

    config = launcher.chained_launch_config(driver, (64, 4, 1, 256, 1, 1), 0)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (64, 4, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (256, 1, 1)
    assert config.numAttrs == 1 and config.sharedMemBytes == 0
    attribute, = config.attrs
    assert attribute.id == (driver.CUlaunchAttributeID
                            .CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    assert attribute.value.programmaticStreamSerializationAllowed == 1


@pytest.mark.gpu
@pytest.mark.parametrize("chained", [True, False])
def test_chained_kernels_back_to_back_in_a_graph_see_each_others_finished_writes(chained):
    """World 1 as pack + merge, eight times in one captured graph, each time on other
    scores into one keys buffer: a merge that ran ahead of its pack would read the
    previous pack's keys, and a pack that ran ahead of the merge before it would
    overwrite the keys that merge reads."""
    if TARGET.simulator:
        pytest.skip("graphs and chained launches need a GPU")
    import cupy

    rounds, heads, tokens, blocks, topk = 8, 4, 64, 256, 16
    window = dict(query_len=1, init_blocks=1, local_blocks=2)
    seq = np.full(tokens, blocks * 128, np.int32)
    seq[1::3] = 100 * 128 + 5
    host = np.random.default_rng(5).standard_normal(
        (rounds, heads, tokens, blocks)).astype(np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    previous = launcher.set_chained_launches(chained)
    try:
        with stream:
            scores, seq_d = cupy.asarray(host), cupy.asarray(seq)
            keys = cupy.zeros((1, heads, tokens, topk), cupy.int64)
            idx = cupy.full((rounds, heads, tokens, topk), -7, cupy.int32)

            def exchange(s, r):
                numba_cp.local_topk_keys(scores[r], seq_d, topk=topk, rank=0, world=1,
                                         global_blocks=blocks, out=keys[0], stream=s, **window)
                numba_cp.merge_topk_keys(keys, idx[r], seq_d, stream=s, **window)

            exchange(stream, 0)  # compile outside the capture
            stream.synchronize()
            stream.begin_capture()
            for r in range(rounds):
                exchange(stream, r)
            graph = stream.end_capture()
            for _ in range(3):
                idx.fill(-7)
                graph.launch(stream)
                stream.synchronize()
                got = idx.get()
                for r in range(rounds):
                    want = ref.merge_topk_keys(ref.local_topk_keys(
                        host[r], seq, topk=topk, rank=0, world=1, global_blocks=blocks,
                        **window)[None], seq, topk=topk, **window)
                    np.testing.assert_array_equal(got[r], want, err_msg=f"round {r}")
    finally:
        launcher.set_chained_launches(previous)


class _Driver:
    """The two launch calls of cuda.bindings' driver, answering as told."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, chained_status, ordinary_status=0):
        self.chained_status, self.ordinary_status = chained_status, ordinary_status
        self.calls = []

    def cuLaunchKernelEx(self, config, function, params, extra):
        self.calls.append("chained")
        return (self.chained_status,)

    def cuLaunchKernel(self, function, *args):
        self.calls.append("ordinary")
        return (self.ordinary_status,)


def _direct_launch(driver):
    """A direct launch of a chained kernel with ``driver`` in place of the binding."""
    import threading

    launch = object.__new__(launcher._DirectLaunch)
    launch.driver, launch.function, launch.cu_kernel = driver, "function", None
    launch.dims, launch.params_address, launch.values = (1, 1, 1, 32, 1, 1), 0, []
    launch.pointer_slots, launch.lock, launch.use_driver = [], threading.Lock(), True
    launch.written = None
    stream = type("Stream", (), {"handle": 0})()
    launch.chainable, launch.configs = True, {stream: "config"}
    return launch, stream


@pytest.fixture
def chaining_on(monkeypatch):
    monkeypatch.setattr(launcher, "_CHAINING", [True])
    monkeypatch.setattr(launcher, "resolve_stream", lambda stream, like: stream)


def test_a_refused_chained_launch_is_launched_the_ordinary_way_from_then_on(chaining_on):
    driver = _Driver(chained_status=801)  # CUDA_ERROR_NOT_SUPPORTED
    launch, stream = _direct_launch(driver)
    with pytest.warns(RuntimeWarning, match="refused a chained kernel launch"):
        launch([None], stream)
    assert driver.calls == ["chained", "ordinary"]
    assert launcher.chained_launches() is False
    launch([None], stream)
    assert driver.calls == ["chained", "ordinary", "ordinary"]


def test_a_launch_that_fails_both_ways_raises_and_keeps_chaining(chaining_on):
    driver = _Driver(chained_status=700, ordinary_status=700)  # an earlier kernel's fault
    launch, stream = _direct_launch(driver)
    with pytest.raises(RuntimeError, match="kernel launch failed: 700"):
        launch([None], stream)
    assert launcher.chained_launches() is True


def test_a_chained_launch_goes_to_cuLaunchKernelEx_alone(chaining_on):
    driver = _Driver(chained_status=0)
    launch, stream = _direct_launch(driver)
    launch([None], stream)
    launch.chainable = False  # a kernel that does not open with chain_grids()
    launch([None], stream)
    assert driver.calls == ["chained", "ordinary"]


@pytest.mark.parametrize("setting", ["yes", "2", "off"])
def test_a_chained_launch_setting_other_than_0_or_1_is_refused_by_name(monkeypatch, setting):
    monkeypatch.setattr(launcher, "_CHAINING", [None])
    monkeypatch.setenv(launcher.CHAINED_ENV, setting)
    with pytest.raises(ValueError, match=f"NUMBA_CP_CHAINED_LAUNCH must be 0 .* got '{setting}'"):
        launcher.chained_launches()


def test_chained_launches_0_turns_chaining_off(monkeypatch):
    monkeypatch.setattr(launcher, "_CHAINING", [None])
    monkeypatch.setenv(launcher.CHAINED_ENV, "0")
    assert launcher.chained_launches() is False


def test_a_bad_setting_is_raised_from_a_launch_not_taken_for_a_refused_binding(monkeypatch):
    monkeypatch.setattr(launcher, "_CHAINING", [None])
    monkeypatch.setattr(launcher, "resolve_stream", lambda stream, like: stream)
    monkeypatch.setenv(launcher.CHAINED_ENV, "on")
    driver = _Driver(chained_status=0)
    launch, stream = _direct_launch(driver)
    with pytest.raises(ValueError, match="NUMBA_CP_CHAINED_LAUNCH"):
        launch([None], stream)
    assert launch.use_driver and driver.calls == []
