"""The oracle against hand-worked values from SPEC.md (no kernels involved)."""

import numpy as np
import pytest

from numba_cp import reference as ref
from numba_cp.constants import INIT_SCORE, LOCAL_SCORE


def key(score, block):
    return int(ref.pack_keys(np.array([score], np.float32), np.array([block]))[0])


def test_key_layout_matches_spec_bits():
    # 1.0f = 0x3F800000, positive: ordered = bits ^ 0x80000000
    assert key(1.0, 5) == (1 << 48) | (0xBF800000 << 16) | 6
    # -1.0f = 0xBF800000, negative: ordered = bits ^ 0xFFFFFFFF
    assert key(-1.0, 0) == (1 << 48) | (0x407FFFFF << 16) | 1
    assert key(np.nan, 7) == (1 << 48) | 8


def test_key_order():
    assert key(-0.0, 3) == key(0.0, 3)
    assert key(np.nan, 9) < key(-np.inf, 0) < key(-1.0, 0) < key(0.0, 0) < key(np.inf, 0)
    assert key(-np.nan, 9) == key(np.nan, 9)
    assert key(2.0, 4) > key(2.0, 3)  # ties go to the higher block id
    assert key(LOCAL_SCORE, 0) < key(INIT_SCORE, 0)


def test_unpack_round_trip():
    scores = np.array([1.5, -2.25, np.inf, -np.inf, 0.0, 1e30], np.float32)
    blocks = np.arange(6) * 1000
    got_blocks, got_scores = ref.unpack_keys(ref.pack_keys(scores, blocks))
    np.testing.assert_array_equal(got_blocks, blocks)
    np.testing.assert_array_equal(got_scores, scores)


@pytest.mark.parametrize("seq_len,query_len,t,expected", [
    (129, 1, 0, (129, 2, 0)),
    (128, 1, 0, (128, 1, 0)),
    (0, 1, 0, (0, 0, 0)),
    (2, 4, 0, (-1, 0, 0)),  # padded row: seq_len below query_len
    (300, 4, 3, (300, 3, 1)),
])
def test_row_window(seq_len, query_len, t, expected):
    assert ref.row_window(seq_len, t, query_len=query_len, local_blocks=2) == expected


def test_pins_local_overrides_init():
    full = np.full((1, 1, 3), -5.0, np.float32)  # 3 blocks, all low scores
    seq = np.array([3 * 128], np.int32)
    # init 3 and local 1: blocks 0,1 pinned 1e30, block 2 both -> 1e29
    keys = ref.local_topk_keys(full, seq, topk=3, rank=0, world=1, query_len=1,
                               global_blocks=3, init_blocks=3, local_blocks=1)
    blocks, scores = ref.unpack_keys(keys[0, 0])
    assert blocks.tolist() == [1, 0, 2]
    assert scores.tolist() == [INIT_SCORE, INIT_SCORE, LOCAL_SCORE]


def test_shard_skips_invalid_columns_and_pads():
    shard = np.array([[[3.0, 2.0, 1.0, np.inf]]], np.float32)  # rank 1 of 2: blocks 1,3,5,7
    seq = np.array([4 * 128], np.int32)  # valid blocks 0..3
    keys = ref.local_topk_keys(shard, seq, topk=4, rank=1, world=2, query_len=1,
                               global_blocks=8, init_blocks=0, local_blocks=0)
    assert keys[0, 0].tolist() == [key(3.0, 1), key(2.0, 3), 0, 0]


def test_merge_repins_with_row_window():
    # A key scored 0.5 for block 0 becomes the init pin; block 9 is local.
    gathered = np.array([[[[key(0.5, 0), key(7.0, 5)]]], [[[key(0.1, 9), 0]]]], np.int64)
    seq = np.array([10 * 128], np.int32)
    idx = ref.merge_topk_keys(gathered, seq, topk=4, query_len=1, init_blocks=1,
                              local_blocks=1)
    assert idx[0, 0].tolist() == [0, 9, 5, -1]


def test_sparse_table_hand_example():
    # Row at position 300: self block 2 (tokens 256..300), ctx_len 301.
    topk_idx = np.array([[[2, 0, -1, 1]]], np.int32)
    seq = np.array([301], np.int32)
    table = np.array([[10, 20, 30]], np.int32)
    sbt, ctx = ref.sparse_block_table(topk_idx, seq, table, query_len=1)
    pages = np.arange(8)
    np.testing.assert_array_equal(sbt[0, 0, :24], np.concatenate(
        [10 * 8 + pages, 20 * 8 + pages, 30 * 8 + pages]))  # full blocks first, then tail
    assert not sbt[0, 0, 24:].any()
    assert ctx[0, 0] == 2 * 128 + (301 - 256)
    sbt16, _ = ref.sparse_block_table(topk_idx, seq, table, query_len=1, block_page_stride=16)
    np.testing.assert_array_equal(sbt16[0, 0, :8], 10 * 16 + pages)


def test_sparse_table_without_tail_and_padded_row():
    topk_idx = np.array([[[0, -1], [0, 1]]], np.int32)
    seq = np.array([200, 0], np.int32)  # query_len 1, two requests
    table = np.array([[4, 5], [6, 7]], np.int32)
    sbt, ctx = ref.sparse_block_table(topk_idx, seq, table, query_len=1)
    assert ctx[0].tolist() == [128, 0]  # min(n_used * 128, ctx_len); padded row is empty
    assert not sbt[0, 1].any()


def test_global_topk_is_plain_top_k_of_forced_row():
    rng = np.random.default_rng(1)
    full = rng.standard_normal((1, 1, 20)).astype(np.float32)
    seq = np.array([20 * 128], np.int32)
    idx = ref.global_topk(full, seq, topk=5, query_len=1, global_blocks=20, init_blocks=0,
                          local_blocks=0)
    assert idx[0, 0].tolist() == np.argsort(-full[0, 0])[:5].tolist()
