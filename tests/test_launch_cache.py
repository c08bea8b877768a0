"""Validated launches are cached per argument signature, and the cache never skips a check.

On a GPU the second call of a signature takes the direct cuda.core launch; the
results must not change.
"""

import numpy as np
import pytest

import numba_cp
from numba_cp import ops
from numba_cp import reference as ref
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
