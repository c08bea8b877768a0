"""local_topk_keys kernel against the NumPy oracle."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_cp
from numba_cp import reference as ref
from support import (THREADS, Case, cases, kernel_examples, launches, planned_kernels, to_device,
                     to_host)

SENTINEL = np.int64(-7)


def run_shard(case, rank, *, fill, extra_columns=0, out_extra=0, strided=False, **launch):
    """Kernel keys of ``rank``'s shard, with garbage columns and padded/strided views."""
    local = -(-case.global_blocks // case.world) + extra_columns
    shard = ref.shard_scores(case.full_scores, rank=rank, world=case.world,
                             global_blocks=case.global_blocks, local=local, fill=fill)
    heads, tokens = case.heads, case.tokens
    if strided:  # tokens-major storage, viewed as [heads, tokens, local]; every other column
        base = np.full((tokens, heads, 2 * local + 1), np.inf, np.float32)
        base[:, :, 1::2] = shard.transpose(1, 0, 2)
        scores = to_device(base).transpose(1, 0, 2)[:, :, 1::2]
        out_base = to_device(np.full((heads, tokens, 2 * (case.topk + out_extra)), SENTINEL))
        out = out_base[:, :, ::2]
    else:
        scores = to_device(shard)
        out = to_device(np.full((heads, tokens, case.topk + out_extra), SENTINEL))
    result = numba_cp.local_topk_keys(
        scores, to_device(case.seq_lens), topk=case.topk, rank=rank, out=out,
        **launch, **case.shard_args)
    assert result is out
    expected = ref.local_topk_keys(shard, case.seq_lens, topk=case.topk, rank=rank,
                                   **case.shard_args)
    return to_host(out), expected, (to_host(out_base) if strided else None)


@kernel_examples(60)
@given(case=cases(), data=st.data())
def test_matches_oracle(case, data):
    rank = data.draw(st.integers(0, case.world - 1), label="rank")
    got, expected, _ = run_shard(
        case, rank,
        fill=data.draw(st.sampled_from([np.nan, np.inf, 3e38]), label="fill"),
        extra_columns=data.draw(st.integers(0, 2), label="extra_columns"),
        **data.draw(launches(), label="launch"))
    np.testing.assert_array_equal(got, expected)


def planned_pack(case, rank, **kwargs):
    """run_shard on a launch cache of its own: its results and the kernel it planned."""
    with planned_kernels("_PACK_LAUNCHES") as names:
        result = run_shard(case, rank, **kwargs)
    (name,) = names
    return result, name


@kernel_examples(30)
@given(case=cases(), data=st.data())
def test_pack_by_address_matches_oracle(case, data):
    """With ``addressed=True`` the warp and rank packs take C-contiguous arrays by
    address; strided views, the radix family and int64 seq_lens keep Numba's arrays.
    Every result is the oracle's, and the tail of ``out`` stays untouched."""
    strided = data.draw(st.booleans(), label="strided")
    if data.draw(st.booleans(), label="int64 seq_lens"):
        case = dataclasses.replace(case, seq_lens=case.seq_lens.astype(np.int64))
    out_extra = data.draw(st.integers(0, 2), label="out_extra")
    extra_columns = data.draw(st.integers(0, 2), label="extra_columns")
    (got, expected, _), name = planned_pack(
        case, data.draw(st.integers(0, case.world - 1), label="rank"), fill=np.inf,
        extra_columns=extra_columns, out_extra=out_extra, strided=strided, addressed=True,
        **data.draw(launches(), label="launch"))
    np.testing.assert_array_equal(got[:, :, :case.topk], expected)
    assert (got[:, :, case.topk:] == SENTINEL).all(), "columns past topk were written"
    # run_shard's strided views, as NumPy judges them (an axis of extent 1 may have
    # any stride), which is how the wrapper judges them too
    local = -(-case.global_blocks // case.world) + extra_columns
    heads, tokens, width = case.heads, case.tokens, case.topk + out_extra
    contiguous = not strided or (
        np.empty((tokens, heads, 2 * local + 1)).transpose(1, 0, 2)[:, :, 1::2]
        .flags.c_contiguous and np.empty((heads, tokens, 2 * width))[:, :, ::2]
        .flags.c_contiguous)
    small_row_family = name.endswith(("_warp", "_rank"))
    expect = small_row_family and contiguous and case.seq_lens.dtype == np.int32
    assert name.endswith(("_addressed_warp", "_addressed_rank")) == expect, name


def fixed_case(rng):
    return Case(rng.standard_normal((2, 3, 120)).astype(np.float32),
                np.array([120 * 128, 50 * 128 + 3, 4 * 128], np.int32), world=3, topk=10,
                query_len=1, global_blocks=120, init_blocks=1, local_blocks=2)


@pytest.mark.parametrize("method", ["warp", "rank"])
def test_addressed_picks_the_pack(method):
    case = fixed_case(np.random.default_rng(4))
    names = {}
    for addressed in (None, False, True):
        (got, expected, _), names[addressed] = planned_pack(case, 1, fill=np.inf,
                                                            method=method, addressed=addressed)
        np.testing.assert_array_equal(got, expected)
    assert names == {None: f"shard_topk_keys_addressed_{method}",
                     False: f"shard_topk_keys_{method}",
                     True: f"shard_topk_keys_addressed_{method}"}


def test_a_bad_addressed_is_named_by_the_pack():
    case = fixed_case(np.random.default_rng(0))
    with pytest.raises(TypeError, match="addressed must be True, False or None"):
        run_shard(case, 0, fill=np.inf, addressed="on")


@kernel_examples(15)
@given(case=cases(max_world=4), out_extra=st.integers(1, 3))
def test_strided_views_and_untouched_tail(case, out_extra):
    got, expected, out_base = run_shard(case, 0, fill=np.inf, extra_columns=1,
                                        out_extra=out_extra, strided=True)
    np.testing.assert_array_equal(got[:, :, :case.topk], expected)
    assert (got[:, :, case.topk:] == SENTINEL).all(), "columns past topk were written"
    assert (out_base[:, :, 1::2] == SENTINEL).all(), "out was written outside its view"


@pytest.mark.parametrize("launch", [dict(method="radix"), dict(method="radix", sort_limit=1),
                                    dict(method="warp"), dict(method="warp", threads=None,
                                                              sort_limit=1)])
def test_large_shard_radix_and_sort_paths(launch):
    """A shard wider than the sort tile, with many equal scores and specials."""
    rng = np.random.default_rng(5)
    heads, tokens, global_blocks, world = 1, 2, 600, 2
    full = rng.integers(-3, 3, size=(heads, tokens, global_blocks)).astype(np.float32)
    full[0, 0, ::7] = np.nan
    full[0, 1, ::5] = -0.0
    from support import Case
    case = Case(full, np.array([global_blocks * 128, 333 * 128 + 5], np.int32), world=world,
                topk=9, query_len=1, global_blocks=global_blocks, init_blocks=2,
                local_blocks=3)
    got, expected, _ = run_shard(case, 1, fill=np.nan, **launch)
    np.testing.assert_array_equal(got, expected)


def test_zero_tokens_is_a_no_op():
    out = to_device(np.zeros((2, 0, 4), np.int64))
    res = numba_cp.local_topk_keys(to_device(np.zeros((2, 0, 3), np.float32)),
                                   to_device(np.zeros(0, np.int32)), topk=4, rank=0, world=1,
                                   query_len=1, global_blocks=3, init_blocks=0,
                                   local_blocks=0, out=out)
    assert res is out


def test_deterministic_across_launch_shapes():
    rng = np.random.default_rng(11)
    from support import Case
    case = Case(rng.integers(0, 2, size=(2, 3, 40)).astype(np.float32),
                np.array([40 * 128, 17 * 128, 5], np.int32), world=1, topk=10, query_len=1,
                global_blocks=40, init_blocks=1, local_blocks=1)
    from numba_cp.kernels.primitives import WARP_LANES
    shapes = [("radix", 1, None), ("radix", 4, None), ("radix", 3, 1), ("radix", THREADS, 8),
              ("warp", WARP_LANES, 1), ("warp", 4 * WARP_LANES, None), ("auto", None, None)]
    results = [run_shard(case, 0, fill=np.nan, method=m, threads=t, sort_limit=s)[0]
               for m, t, s in shapes]
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)


@pytest.mark.parametrize("order", ["descending", "ascending", "ties", "nan"])
@pytest.mark.parametrize("topk_of_lanes", [1.0, 0.5, 0.25])
def test_rank_pack_of_several_chunks(order, topk_of_lanes):
    """Rank packs of several chunks on rows sorted either way (all the top keys in
    one chunk's run), with ties and with NaN, at ``topk`` of a whole run, half and a
    quarter of one: the last place at a run's end or inside it."""
    from numba_cp.kernels.primitives import WARP_LANES
    topk = max(1, int(WARP_LANES * topk_of_lanes))
    blocks = 16 * WARP_LANES
    column = np.arange(blocks, dtype=np.float32)
    row = {"descending": -column, "ascending": column,
           "ties": (column % 3).astype(np.float32),
           "nan": np.where(column % 5 == 0, np.nan, np.sin(column)).astype(np.float32)}[order]
    scores = np.stack([row, row[::-1]])[None].repeat(2, 0)  # [heads, tokens, blocks]
    seq_lens = np.array([blocks * 128, blocks * 64 + 5], np.int32)
    args = dict(world=1, query_len=1, global_blocks=blocks, init_blocks=0, local_blocks=0)
    expected = ref.local_topk_keys(scores, seq_lens, topk=topk, rank=0, **args)
    for threads, sort_limit in ((WARP_LANES, WARP_LANES), (2 * WARP_LANES, 2 * WARP_LANES),
                                (4 * WARP_LANES, None)):
        out = to_device(np.full((2, 2, topk), SENTINEL))
        numba_cp.local_topk_keys(to_device(scores), to_device(seq_lens), topk=topk, rank=0,
                                 out=out, method="rank", threads=threads,
                                 sort_limit=sort_limit, **args)
        np.testing.assert_array_equal(to_host(out), expected,
                                      err_msg=f"threads={threads}, sort_limit={sort_limit}")
