"""SPEC.md's exactness promise: the CP exchange equals the unsharded top-k, any world."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_cp
from numba_cp import reference as ref
from support import (THREADS, Case, cases, kernel_examples, score_matrix, seq_len_choices,
                     to_device, to_host)


@settings(max_examples=200)
@given(case=cases(max_requests=4, max_global_blocks=64, max_topk=16))
def test_fake_cp_oracle_equals_unsharded(case):
    merged = ref.fake_cp_exchange(case.full_scores, case.seq_lens, world=case.world,
                                  topk=case.topk, global_blocks=case.global_blocks,
                                  **case.window)
    unsharded = ref.global_topk(case.full_scores, case.seq_lens, topk=case.topk,
                                global_blocks=case.global_blocks, **case.window)
    np.testing.assert_array_equal(merged, unsharded)


RADIX = dict(method="radix", threads=THREADS)
WARP = dict(method="warp")


def kernel_exchange(case, *, per_shard, table=None, launch=WARP):
    """pack on every rank -> stack (the all-gather) -> merge, all through the kernels."""
    local = -(-case.global_blocks // case.world)
    gathered = to_device(np.zeros((case.world, case.heads, case.tokens, per_shard), np.int64))
    seq_lens = to_device(case.seq_lens)
    for r in range(case.world):
        shard = ref.shard_scores(case.full_scores, rank=r, world=case.world,
                                 global_blocks=case.global_blocks, local=local)
        numba_cp.local_topk_keys(to_device(shard), seq_lens, topk=per_shard, rank=r,
                                 out=gathered[r], **launch, **case.shard_args)
    topk_idx = to_device(np.zeros((case.heads, case.tokens, case.topk), np.int32))
    extra = {}
    if table is not None:
        extra = dict(attention_block_table=to_device(table),
                     sparse_block_table_out=to_device(
                         np.zeros((case.heads, case.tokens, case.topk * 8), np.int32)),
                     sparse_context_lens_out=to_device(
                         np.zeros((case.heads, case.tokens), np.int32)))
    numba_cp.merge_topk_keys(gathered, topk_idx, seq_lens, **launch, **case.window,
                             **extra)
    if table is None:
        return to_host(topk_idx)
    return (to_host(topk_idx), to_host(extra["sparse_block_table_out"]),
            to_host(extra["sparse_context_lens_out"]))


@pytest.mark.parametrize("launch", [WARP, RADIX], ids=["warp", "radix"])
@pytest.mark.parametrize("world", range(1, 9))
def test_kernel_exchange_equals_unsharded(world, launch):
    rng = np.random.default_rng(100 + world)
    requests, query_len, global_blocks, topk = 2, 2, 45, 9
    case = Case(score_matrix(rng, (2, requests * query_len, global_blocks), "special"),
                seq_len_choices(rng, requests, query_len, global_blocks), world=world,
                topk=topk, query_len=query_len, global_blocks=global_blocks, init_blocks=1,
                local_blocks=2)
    case.seq_lens[0] = global_blocks * 128  # at least one full-length request
    unsharded = ref.global_topk(case.full_scores, case.seq_lens, topk=topk,
                                global_blocks=global_blocks, **case.window)
    np.testing.assert_array_equal(kernel_exchange(case, per_shard=topk, launch=launch), unsharded)
    np.testing.assert_array_equal(kernel_exchange(case, per_shard=topk + 3, launch=launch),
                                  unsharded)


@pytest.mark.parametrize("launch", [WARP, RADIX], ids=["warp", "radix"])
@pytest.mark.parametrize("world", [1, 3, 8])
def test_kernel_exchange_with_sparse_table(world, launch):
    rng = np.random.default_rng(7 * world)
    case = Case(score_matrix(rng, (1, 3, 40), "ties"), np.array([40 * 128, 1000, 2], np.int32),
                world=world, topk=8, query_len=1, global_blocks=40, init_blocks=1,
                local_blocks=1)
    table = rng.integers(0, 500, size=(3, 40), dtype=np.int32)
    got = kernel_exchange(case, per_shard=8, table=table, launch=launch)
    unsharded = ref.global_topk(case.full_scores, case.seq_lens, topk=8, global_blocks=40,
                                **case.window)
    exp_sbt, exp_ctx = ref.sparse_block_table(unsharded, case.seq_lens, table, query_len=1)
    np.testing.assert_array_equal(got[0], unsharded)
    np.testing.assert_array_equal(got[1], exp_sbt)
    np.testing.assert_array_equal(got[2], exp_ctx)


@kernel_examples(60)
@given(case=cases(max_requests=4, max_global_blocks=64, max_topk=16), data=st.data())
def test_world_one_in_one_kernel_equals_unsharded(case, data):
    """global_topk_ids: the scores' top-k ids (and table) in one kernel, against the
    unsharded oracle; the columns past global_blocks hold garbage that is never read."""
    launch = data.draw(st.sampled_from([WARP, RADIX, dict(method="radix", sort_limit=1)]),
                       label="launch")
    garbage = data.draw(st.sampled_from([np.nan, np.inf, 3.0e38]), label="garbage")
    scores = np.concatenate([case.full_scores,
                             np.full(case.full_scores.shape[:2] + (3,), garbage, np.float32)],
                            axis=2)
    seq_lens = to_device(case.seq_lens)
    window = dict(case.window)
    want = ref.global_topk(case.full_scores, case.seq_lens, topk=case.topk,
                           global_blocks=case.global_blocks, **window)
    topk_idx = to_device(np.full((case.heads, case.tokens, case.topk), -7, np.int32))
    table = None
    extra = {}
    if data.draw(st.booleans(), label="table"):
        table = np.random.default_rng(case.topk).integers(
            0, 1000, size=(case.seq_lens.size, case.global_blocks + 2), dtype=np.int32)
        sbt = to_device(np.full((case.heads, case.tokens, case.topk * 8), -7, np.int32))
        ctx = to_device(np.full((case.heads, case.tokens), -7, np.int32))
        extra = dict(attention_block_table=to_device(table), sparse_block_table_out=sbt,
                     sparse_context_lens_out=ctx)
    numba_cp.ops.global_topk_ids(to_device(scores), seq_lens, topk_idx,
                                 global_blocks=case.global_blocks, **launch, **window, **extra)
    np.testing.assert_array_equal(to_host(topk_idx), want)
    if table is not None:
        want_sbt, want_ctx = ref.sparse_block_table(want, case.seq_lens, table,
                                                    query_len=case.query_len)
        np.testing.assert_array_equal(to_host(sbt), want_sbt)
        np.testing.assert_array_equal(to_host(ctx), want_ctx)
