"""Validated launches are cached per argument signature, and the cache never skips a check.

On numba-cuda the second call of a signature takes the direct ``cuLaunchKernel``
path; the results must not change, and when an internal it reads is missing
the launch falls back to Numba's dispatch with one warning.
"""

import dataclasses
import sys
import types
import warnings

import numpy as np
import pytest

import numba_cp
from numba_cp import _numba, launcher, ops
from numba_cp import reference as ref
from numba_cp.backend import TARGET
from numba_cp.launcher import LaunchCache
from support import to_device, to_host

ARGS = dict(topk=4, rank=1, world=2, query_len=1, global_blocks=20, init_blocks=1,
            local_blocks=1)


def shard(seed):
    full = np.random.default_rng(seed).standard_normal((2, 3, 20)).astype(np.float32)
    return ref.shard_scores(full, rank=1, world=2, global_blocks=20)


def test_same_signature_new_data_is_recomputed(monkeypatch):
    seq = np.array([20 * 128, 900, 5], np.int32)
    planned = []
    real = ops._plan_local_topk
    monkeypatch.setattr(ops, "_plan_local_topk", lambda *a: planned.append(a) or real(*a))
    for seed in range(3):
        scores, out = to_device(shard(seed)), to_device(np.zeros((2, 3, 4), np.int64))
        numba_cp.local_topk_keys(scores, to_device(seq), out=out, **ARGS)
        expected = ref.local_topk_keys(shard(seed), seq, **ARGS)
        np.testing.assert_array_equal(to_host(out), expected)
    assert len(planned) == 1, "one signature, one validation"


class Described:
    """An array known only by its ``__cuda_array_interface__`` (over no memory)."""

    def __init__(self, shape, pointer):
        self.shape = shape
        self.__cuda_array_interface__ = dict(typestr="<i4", shape=shape, strides=None,
                                             data=(pointer, False), version=3)


def test_the_cache_answers_each_signature_with_its_own_launch(monkeypatch):
    """Signatures in turn, repeated, then after the table is cleared: each call gets the
    launch planned for its signature, and each signature is planned once per filling
    (the last signature found is kept beside the table, and must never answer another)."""
    # keys as on a GPU target, HIP: CUDA's would ask the driver for the context
    monkeypatch.setattr(launcher, "TARGET", dataclasses.replace(TARGET, name="hip"))
    monkeypatch.setattr(launcher, "_SIGNERS", (None, None, None))
    cache, planned = LaunchCache(), []

    def plan(arrays, *scalars):
        planned.append((arrays[0].shape, scalars))
        return ("launch", arrays[0].shape, scalars)

    wide, narrow = Described((2, 8), 4096), Described((2, 4), 8192)
    calls = [(wide, (1, 2)), (wide, (1, 2)), (narrow, (1, 2)), (wide, (1, 2)),
             (wide, (1, 2.0)), (wide, (1, True)), (wide, (1, 1)), (wide, (1, 2))]
    for array, scalars in calls:
        launch, pointers = cache.launch_for((array,), scalars, plan)
        assert launch == ("launch", array.shape, scalars)
        assert type(launch[2][1]) is type(scalars[1])
        assert pointers == [array.__cuda_array_interface__["data"][0]]
    assert len(planned) == 5  # (8, 2), (4, 2), (8, 2.0), (8, True), (8, 1)
    cache.clear()
    assert cache.launch_for((wide,), (1, 2), plan)[0] == ("launch", (2, 8), (1, 2))
    assert len(planned) == 6, "a cleared table plans again"
    unhashable = [3]
    for _ in range(2):
        assert cache.launch_for((wide,), (1, unhashable), plan)[0][2] == (1, [3])
    assert len(planned) == 8, "an unhashable scalar is validated on every call"


def test_cached_signature_still_rejects_a_float_or_bool_scalar():
    scores, seq = to_device(shard(0)), to_device(np.full(3, 999, np.int32))
    out = to_device(np.zeros((2, 3, 4), np.int64))
    numba_cp.local_topk_keys(scores, seq, out=out, **ARGS)
    with pytest.raises(TypeError, match="topk"):
        numba_cp.local_topk_keys(scores, seq, out=out, **dict(ARGS, topk=4.0))
    with pytest.raises(TypeError, match="rank"):
        numba_cp.local_topk_keys(scores, seq, out=out, **dict(ARGS, rank=True))


def test_new_strides_or_shapes_are_validated_again():
    seq = to_device(np.full(3, 999, np.int32))
    out = to_device(np.zeros((2, 3, 4), np.int64))
    numba_cp.local_topk_keys(to_device(shard(0)), seq, out=out, **ARGS)
    narrow = to_device(np.zeros((2, 3, 3), np.int64))
    with pytest.raises(ValueError, match="out"):
        numba_cp.local_topk_keys(to_device(shard(0)), seq, out=narrow, **ARGS)
    strided = to_device(np.zeros((2, 3, 8), np.int64))[:, :, ::2]
    numba_cp.local_topk_keys(to_device(shard(1)), seq, out=strided, **ARGS)
    expected = ref.local_topk_keys(shard(1), to_host(seq), **ARGS)
    np.testing.assert_array_equal(to_host(strided), expected)


def test_merge_with_2d_table_repeats_exactly():
    rng = np.random.default_rng(9)
    keys = np.stack([ref.local_topk_keys(
        ref.shard_scores(rng.standard_normal((1, 4, 30)).astype(np.float32), rank=r, world=2,
                         global_blocks=30), np.full(4, 30 * 128, np.int32), topk=6, rank=r,
        world=2, query_len=1, global_blocks=30, init_blocks=1, local_blocks=1)
        for r in range(2)])
    seq = np.array([30 * 128, 2000, 700, 128], np.int32)
    table = rng.integers(0, 300, size=(4, 30), dtype=np.int32)
    want_idx, want_sbt, want_ctx = ref.merge_topk_keys(
        keys, seq, topk=6, query_len=1, init_blocks=1, local_blocks=1,
        attention_block_table=table)
    for _ in range(3):
        idx = to_device(np.zeros((1, 4, 6), np.int32))
        sbt = to_device(np.zeros((4, 48), np.int32))
        ctx = to_device(np.zeros(4, np.int32))
        numba_cp.merge_topk_keys(to_device(keys), idx, to_device(seq), query_len=1,
                                 init_blocks=1, local_blocks=1,
                                 attention_block_table=to_device(table),
                                 sparse_block_table_out=sbt, sparse_context_lens_out=ctx)
        np.testing.assert_array_equal(to_host(idx), want_idx)
        np.testing.assert_array_equal(to_host(sbt), want_sbt[0])
        np.testing.assert_array_equal(to_host(ctx), want_ctx[0])


def _merge_inputs(seed=9):
    rng = np.random.default_rng(seed)
    keys = np.stack([ref.local_topk_keys(
        ref.shard_scores(rng.standard_normal((1, 4, 30)).astype(np.float32), rank=r, world=2,
                         global_blocks=30), np.full(4, 30 * 128, np.int32), topk=6, rank=r,
        world=2, query_len=1, global_blocks=30, init_blocks=1, local_blocks=1)
        for r in range(2)])
    return keys, np.array([30 * 128, 2000, 700, 128], np.int32)


@pytest.fixture
def fresh_caches(monkeypatch):
    """Empty launch caches, so that the launches a test makes are the only ones there."""
    monkeypatch.setattr(ops, "_PACK_LAUNCHES", LaunchCache())
    monkeypatch.setattr(ops, "_MERGE_LAUNCHES", LaunchCache())


def _counting(launch):
    """Count the calls that go through ``launch``'s direct path."""
    calls = []
    direct = launch._direct

    def counted(*args):
        calls.append(args)
        return direct(*args)

    launch._direct = counted
    return calls


@pytest.mark.gpu
def test_repeated_calls_take_the_direct_path(fresh_caches):
    if TARGET.name != "cuda":
        pytest.skip("the direct cuLaunchKernel path is numba-cuda's")
    seq = to_device(np.array([20 * 128, 900, 5], np.int32))
    keys, merge_seq = _merge_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn
        out = to_device(np.zeros((2, 3, 4), np.int64))
        numba_cp.local_topk_keys(to_device(shard(0)), seq, out=out, **ARGS)
        pack, = ops._PACK_LAUNCHES.values()
        assert pack.direct, "the first call builds the direct launch"
        pack_calls = _counting(pack)
        idx = to_device(np.zeros((1, 4, 6), np.int32))
        numba_cp.merge_topk_keys(to_device(keys), idx, to_device(merge_seq), query_len=1,
                                 init_blocks=1, local_blocks=1)
        merge, = ops._MERGE_LAUNCHES.values()
        assert merge.direct
        merge_calls = _counting(merge)
        for seed in (1, 2):
            numba_cp.local_topk_keys(to_device(shard(seed)), seq, out=out, **ARGS)
            np.testing.assert_array_equal(
                to_host(out), ref.local_topk_keys(shard(seed), to_host(seq), **ARGS))
            idx = to_device(np.full((1, 4, 6), 7, np.int32))
            numba_cp.merge_topk_keys(to_device(keys), idx, to_device(merge_seq), query_len=1,
                                     init_blocks=1, local_blocks=1)
            np.testing.assert_array_equal(to_host(idx), ref.merge_topk_keys(
                keys, merge_seq, topk=6, query_len=1, init_blocks=1, local_blocks=1))
    assert len(pack_calls) == 2 and len(merge_calls) == 2
    assert list(ops._PACK_LAUNCHES.values()) == [pack]
    assert list(ops._MERGE_LAUNCHES.values()) == [merge]


def test_a_cached_launch_follows_its_arrays_from_call_to_call(fresh_caches):
    """One signature, its arrays swapped between calls (both inputs, both outputs, then
    back, then the same ones twice): each call reads and writes the arrays it is given,
    however many of its pointers repeat the call before (on numba-cuda the direct
    launch rewrites its parameter block only where they moved)."""
    window = dict(query_len=1, init_blocks=1, local_blocks=1)
    inputs = [_merge_inputs(seed) for seed in (9, 10)]
    keys = [to_device(k) for k, _ in inputs]
    seqs = [to_device(s) for _, s in inputs]
    outs = [to_device(np.zeros((1, 4, 6), np.int32)) for _ in range(2)]
    for k, o in ((0, 0), (1, 1), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)):
        outs[o][...] = 7
        numba_cp.merge_topk_keys(keys[k], outs[o], seqs[k], **window)
        np.testing.assert_array_equal(to_host(outs[o]), ref.merge_topk_keys(
            inputs[k][0], inputs[k][1], topk=6, **window), err_msg=f"keys {k}, out {o}")
    assert len(ops._MERGE_LAUNCHES) == 1


def test_direct_launch_fallback_warns_once_naming_the_attribute(monkeypatch, fresh_caches):
    """A missing numba-cuda internal: every launch falls back to Numba's dispatch, exactly,
    and the user hears about it once, with the attribute named."""
    if TARGET.name == "hip":
        pytest.skip("numba-hip launches through its own dispatch only")
    missing = "'CUDADispatcher' object has no attribute '_codelibrary'"

    def compiled_function(dispatcher, args):
        raise AttributeError(missing)

    monkeypatch.setattr(_numba, "compiled_function", compiled_function)
    monkeypatch.setattr(_numba, "_WARNED", set())
    if TARGET.simulator:
        # The simulator never leaves Numba's dispatch: let the launches believe they run
        # on numba-cuda, so that they try the direct path (their kernels still simulate).
        monkeypatch.setattr(launcher, "TARGET", dataclasses.replace(TARGET, name="cuda"))
    seq = np.array([20 * 128, 900, 5], np.int32)
    keys, merge_seq = _merge_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            for heads in (2, 1):  # two signatures of the pack, each called three times
                scores = shard(seed)[:heads]
                out = to_device(np.zeros((heads, 3, 4), np.int64))
                numba_cp.local_topk_keys(to_device(scores), to_device(seq), out=out, **ARGS)
                np.testing.assert_array_equal(to_host(out),
                                              ref.local_topk_keys(scores, seq, **ARGS))
            idx = to_device(np.zeros((1, 4, 6), np.int32))
            numba_cp.merge_topk_keys(to_device(keys), idx, to_device(merge_seq), query_len=1,
                                     init_blocks=1, local_blocks=1)
            np.testing.assert_array_equal(to_host(idx), ref.merge_topk_keys(
                keys, merge_seq, topk=6, query_len=1, init_blocks=1, local_blocks=1))
    fallbacks = [w for w in caught if "direct kernel launch is unavailable" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert fallbacks[0].category is RuntimeWarning
    assert f"AttributeError: {missing}" in str(fallbacks[0].message)
    launches = [*ops._PACK_LAUNCHES.values(), *ops._MERGE_LAUNCHES.values()]
    assert not any(launch.direct for launch in launches)


# Launch shapes the host picks, and that each kernel is compiled for (its launch bounds).
SHAPES = [dict(topk=16, candidates=64, merge=False), dict(topk=16, candidates=256, merge=False),
          dict(topk=32, candidates=128, merge=True), dict(topk=64, candidates=512, merge=False),
          dict(topk=128, candidates=2048, merge=True), dict(topk=5, candidates=40, merge=True)]


@pytest.mark.parametrize("method,threads", [("warp", None), ("warp", 4 * TARGET.lanes),
                                            ("rank", None), ("rank", 2 * TARGET.lanes)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{topk}-{candidates}-{merge}".format(**s))
def test_kernels_are_compiled_for_the_block_they_launch_with(shape, method, threads):
    """The warp and rank kernels carry their block size (CUDA's launch bounds, which cap
    their registers): it must be the block the host launches them with."""
    if method == "rank" and shape["candidates"] > ops.RANK_MAX_ROW:
        pytest.skip("a row longer than the rank kernels take")
    family, kernel_shape, block = ops._family(shape["topk"], shape["candidates"], method,
                                              threads, None, merge=shape["merge"], rows=64)
    assert family.selection(*kernel_shape).threads == block
    if threads is not None:
        assert block == threads


def test_a_block_past_the_compiled_kernels_limit_is_named():
    error = launcher.block_limit_error(1024, 640, "merge_topk_ids_and_table_warp")
    assert isinstance(error, ValueError)
    assert "threads: 1024 threads per block" in str(error) and "threads <= 640" in str(error)
    assert launcher.block_limit_error((256,), 640, "k") is None
    assert launcher.block_limit_error(1024, None, "k") is None


class _ContextDriver:
    """cuda-bindings' ``cuCtxGetCurrent``: a status and a context object."""

    def __init__(self, handle):
        self.handle = handle

    def cuCtxGetCurrent(self):
        return 0, type("CUcontext", (), {"__int__": lambda _: self.handle})()


def _cupy_driver(monkeypatch, ctx_get_current):
    """A ``cupy_backends.cuda.api.driver`` whose ``ctxGetCurrent`` is the one given
    (None: CuPy is not installed)."""
    names = ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.api",
             "cupy_backends.cuda.api.driver")
    if ctx_get_current is None:
        monkeypatch.setitem(sys.modules, names[0], None)  # import raises ImportError
        return
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].ctxGetCurrent = ctx_get_current


@pytest.fixture
def fresh_context_reader(monkeypatch):
    monkeypatch.setattr(launcher, "_driver", lambda: _ContextDriver(0x5000))
    launcher._current_context.cache_clear()
    yield
    launcher._current_context.cache_clear()


def _refuse():
    raise RuntimeError("cuCtxGetCurrent: CUDA_ERROR_SHARED_OBJECT_INIT_FAILED")


@pytest.mark.parametrize("cupy_answer, takes_cupy", [
    (lambda: 0x5000, True),  # installed and agreeing: CuPy's integer answer
    (lambda: 0x6000, False),  # another answer: not trusted
    (_refuse, False),  # a CuPy whose driver functions cannot load
    (None, False),  # no CuPy
])
def test_the_context_token_reads_cupy_only_where_it_answers_as_cuda_bindings(
        monkeypatch, fresh_context_reader, cupy_answer, takes_cupy):
    _cupy_driver(monkeypatch, cupy_answer)
    reader = launcher._current_context()
    assert (reader is cupy_answer) is takes_cupy
    assert reader() == 0x5000
    assert launcher._current_context() is reader, "chosen once"
