"""merge_topk_keys kernel (and its fused sparse block table) against the NumPy oracle."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_cp
from numba_cp import reference as ref
from numba_cp.backend import TARGET
from numba_cp.constants import PAGES
from support import (Case, cases, kernel_examples, launches, planned_kernels, to_device,
                     to_host)

SENTINEL = -7


def gathered_keys(case, per_shard):
    """Every rank's oracle keys, stacked as the all-gather delivers them."""
    return np.stack([
        ref.local_topk_keys(
            ref.shard_scores(case.full_scores, rank=r, world=case.world,
                             global_blocks=case.global_blocks),
            case.seq_lens, topk=per_shard, rank=r, **case.shard_args)
        for r in range(case.world)])


def garbage_keys(rng, shape):
    """Arbitrary int64 words: zeros, negatives, duplicates, non-canonical score bits."""
    keys = rng.integers(-(2**62), 2**62, size=shape, dtype=np.int64)
    # score fields that decode to NaN or -0.0 and so repack differently
    odd_orders = np.array([0x1, 0x7FFFFF, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF], np.int64)
    planted = rng.random(shape) < 0.4
    keys[planted] = ((1 << 48) | (rng.choice(odd_orders, size=int(planted.sum())) << 16)
                     | rng.integers(0, 200, size=int(planted.sum())))
    keys[rng.random(shape) < 0.2] = 0
    flat = keys.reshape(-1)
    if flat.size > 2:
        flat[1] = flat[0]  # a duplicate
    return keys


def block_table(rng, case, width=None):
    requests = case.seq_lens.size
    width = case.global_blocks + 2 if width is None else width
    return rng.integers(0, 1000, size=(requests, width), dtype=np.int32)


def run_merge(keys, case, *, table=None, stride=None, layout="per-head", idx_strided=False,
              keys_strided=False, **launch):
    heads, tokens, topk = case.heads, case.tokens, case.topk
    if idx_strided:
        idx = to_device(np.full((tokens, heads, topk), SENTINEL, np.int32)).transpose(1, 0, 2)
    else:
        idx = to_device(np.full((heads, tokens, topk), SENTINEL, np.int32))
    extra = {}
    if table is not None:
        width = topk * PAGES + 3  # wider than needed: the tail must stay untouched
        if layout == "per-head":
            sbt = to_device(np.full((heads, tokens, width), SENTINEL, np.int32))
            ctx = to_device(np.full((heads, tokens), SENTINEL, np.int32))
        else:
            sbt = to_device(np.full((tokens, width), SENTINEL, np.int32))
            ctx = to_device(np.full((tokens,), SENTINEL, np.int32))
        extra = dict(attention_block_table=to_device(table), sparse_block_table_out=sbt,
                     sparse_context_lens_out=ctx, block_page_stride=stride)
    if keys_strided:  # every other word of a buffer twice as wide
        wider = np.zeros(keys.shape[:-1] + (2 * keys.shape[-1],), np.int64)
        wider[..., ::2] = keys
        gathered = to_device(wider)[..., ::2]
    else:
        gathered = to_device(keys)
    result = numba_cp.merge_topk_keys(gathered, idx, to_device(case.seq_lens),
                                      **launch, **case.window,
                                      **extra)
    assert result is idx
    expected = ref.merge_topk_keys(keys, case.seq_lens, topk=topk,
                                   attention_block_table=table, block_page_stride=stride,
                                   **case.window)
    if table is None:
        np.testing.assert_array_equal(to_host(idx), expected)
        return
    exp_idx, exp_sbt, exp_ctx = expected
    np.testing.assert_array_equal(to_host(idx), exp_idx)
    got_sbt = to_host(sbt).reshape(heads, tokens, -1)
    np.testing.assert_array_equal(got_sbt[:, :, :topk * PAGES], exp_sbt)
    assert (got_sbt[:, :, topk * PAGES:] == SENTINEL).all(), "table written past topk * 8"
    np.testing.assert_array_equal(to_host(ctx).reshape(heads, tokens), exp_ctx)


@kernel_examples(50)
@given(case=cases(), data=st.data())
def test_matches_oracle(case, data):
    per_shard = data.draw(st.integers(1, case.topk + 2), label="per_shard")
    run_merge(gathered_keys(case, per_shard), case,
              idx_strided=data.draw(st.booleans(), label="idx_strided"),
              **data.draw(launches(), label="launch"))


@kernel_examples(30)
@given(case=cases(max_world=4), seed=st.integers(0, 2**32 - 1),
       per_shard=st.integers(1, 8), launch=launches())
def test_garbage_keys_match_oracle(case, seed, per_shard, launch):
    keys = garbage_keys(np.random.default_rng(seed),
                        (case.world, case.heads, case.tokens, per_shard))
    run_merge(keys, case, **launch)


@pytest.mark.slow
@kernel_examples(40)
@given(case=cases(max_heads=3), data=st.data())
def test_sparse_block_table_matches_oracle(case, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    layout = "reference" if case.heads == 1 and data.draw(st.booleans(), label="2d") \
        else "per-head"
    narrow = data.draw(st.booleans(), label="narrow table")  # blocks past its width
    table = block_table(rng, case, width=max(case.global_blocks // 2, 1) if narrow else None)
    run_merge(gathered_keys(case, case.topk), case, table=table, layout=layout,
              stride=data.draw(st.sampled_from([None, 16, 0]), label="stride"),
              **data.draw(launches(), label="launch"))


def test_topk_larger_than_all_candidates():
    rng = np.random.default_rng(3)
    case = Case(rng.standard_normal((2, 2, 30)).astype(np.float32),
                np.array([30 * 128, 900], np.int32), world=3, topk=12, query_len=1,
                global_blocks=30, init_blocks=1, local_blocks=2)
    keys = gathered_keys(case, 2)  # 6 candidates for topk 12
    run_merge(keys, case)
    run_merge(keys, case, table=block_table(rng, case))


@pytest.mark.parametrize("launch", [dict(method="radix"), dict(method="radix", sort_limit=1),
                                    dict(method="warp"), dict(method="warp", sort_limit=1)])
def test_wide_gather_radix_path(launch):
    rng = np.random.default_rng(8)
    case = Case(rng.standard_normal((1, 2, 400)).astype(np.float32),
                np.array([400 * 128, 250 * 128 + 3], np.int32), world=8, topk=20, query_len=1,
                global_blocks=400, init_blocks=2, local_blocks=3)
    run_merge(gathered_keys(case, 24), case, table=block_table(rng, case), **launch)


@pytest.mark.parametrize("width", [1000, 1024, 1025, 1100, 1500])
def test_sparse_table_from_block_tables_around_a_thousand_columns(width):
    """Rows of 1100 blocks against block tables narrower and wider than 1024
    columns, around the row a merge + table block may hold in shared memory: the
    chosen blocks near and past the table's last column must get the oracle's
    pages (and a block past it none)."""
    rng = np.random.default_rng(34)
    scores = rng.standard_normal((1, 2, 1100)).astype(np.float32)
    scores[..., 990:] += 3.0  # the top blocks sit around the tables' last columns
    scores[..., [999, 1000, 1023, 1024, 1099]] += 6.0
    case = Case(scores, np.array([1100 * 128, 1030 * 128 + 5], np.int32), world=4, topk=16,
                query_len=1, global_blocks=1100, init_blocks=1, local_blocks=2)
    keys = gathered_keys(case, case.topk)
    table = block_table(rng, case, width=width)
    for launch in (dict(method="rank"), dict(method="warp"), dict(method="radix")):
        run_merge(keys, case, table=table, **launch)


@pytest.mark.parametrize("swap", [None, "in a lane", "across lanes", "across runs",
                                  "at a run's end"])
@pytest.mark.parametrize("n", [TARGET.lanes, 2 * TARGET.lanes])
def test_sorted_gather_fast_path_and_its_check(n, swap):
    """Gathered runs already in order skip the sort; one pair out of order must not.

    ``per_shard == topk == n`` makes each rank's keys one run: of one warp's
    lanes (the rank merge checks the order by shuffles) and of two (it checks
    in shared memory). The swaps break the order inside a lane, across a lane
    boundary, across two runs and at a run's end. The rank merges run with the
    sparse table too: out of order, keys change threads, and their pages with them.
    """
    pairs = {"in a lane": (0, 1), "across lanes": (1, 2), "across runs": (n - 1, n),
             "at a run's end": (2 * n - 2, 2 * n - 1)}
    rng = np.random.default_rng(21)
    case = Case(rng.standard_normal((2, 3, 200)).astype(np.float32),
                np.array([200 * 128, 120 * 128 + 7, 3 * 128], np.int32), world=4, topk=n,
                query_len=1, global_blocks=200, init_blocks=1, local_blocks=2)
    keys = gathered_keys(case, n)
    assert (np.diff(keys, axis=-1) <= 0).all(), "the pack's keys are descending"
    if swap is not None:
        first, second = pairs[swap]
        flat = keys.reshape(case.world, case.heads, case.tokens, -1).copy()
        rank, column = divmod(first, n)
        other = second % n if second // n == rank else None
        if other is None:  # across ranks: swap the last of one with the first of the next
            flat[rank, :, :, column], flat[rank + 1, :, :, 0] = \
                flat[rank + 1, :, :, 0].copy(), flat[rank, :, :, column].copy()
        else:
            flat[rank, :, :, [column, other]] = flat[rank, :, :, [other, column]]
        keys = flat
    lanes = TARGET.lanes
    table = block_table(np.random.default_rng(5), case)
    for launch in (dict(method="warp"), dict(method="warp", sort_limit=1),
                   dict(method="warp", sort_limit=64), dict(method="rank"),
                   dict(method="rank", threads=lanes), dict(method="rank", threads=4 * lanes)):
        run_merge(keys, case, **launch)
        if launch["method"] == "rank":  # each key's page goes where its key goes
            run_merge(keys, case, table=table, **launch)


# ---------------------------------------------------------------------------
# The merge + table kernels that take their arrays by address and shape


@pytest.mark.slow
@kernel_examples(30)
@given(case=cases(max_heads=3), data=st.data())
def test_sparse_table_by_address_matches_oracle(case, data):
    """With ``addressed=True`` the warp and rank merges with the table take
    C-contiguous arrays by address (the radix family and strided or int64 arrays keep
    Numba's arrays); every output matches the oracle either way."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    layout = "reference" if case.heads == 1 and data.draw(st.booleans(), label="2d") \
        else "per-head"
    narrow = data.draw(st.booleans(), label="narrow table")
    table = block_table(rng, case, width=max(case.global_blocks // 2, 1) if narrow else None)
    launch = data.draw(launches(), label="launch")
    wide_seq_lens = data.draw(st.booleans(), label="int64 seq_lens")
    keys = gathered_keys(case, case.topk)
    keys_strided = data.draw(st.booleans(), label="strided keys")
    # NumPy's test, as the wrapper's: an axis of extent 1 may have any stride
    strided = keys_strided and not np.zeros(keys.shape + (2,))[..., 0].flags.c_contiguous
    if wide_seq_lens:
        case = dataclasses.replace(case, seq_lens=case.seq_lens.astype(np.int64))
    with planned_kernels("_MERGE_LAUNCHES") as names:
        run_merge(keys, case, table=table, layout=layout, keys_strided=keys_strided,
                  stride=data.draw(st.sampled_from([None, 16, 0]), label="stride"),
                  addressed=True, **launch)
    (name,) = names
    small_row_family = name.endswith(("_warp", "_rank"))
    assert ("_addressed" in name) == (small_row_family and not strided and not wide_seq_lens), \
        name


def one_key_each_scores():
    """The scores of the test below: three heads, three rows, 25 columns, of which only
    the first two are in the window."""
    scores = np.full((3, 3, 25), np.nan, np.float32)
    scores[:, :, :2] = [[[-1.8217351e-01, 0.0], [-6.7603135e-01, -8.2942314e-02],
                         [4.1103151e-01, 7.2500944e-02]],
                        [[6.6452272e-02, 2.6445988e-01], [np.nan, -1.3916619e-01],
                         [-7.5815052e-01, 1.8490146e+00]],
                        [[-2.3959079e+00, -np.inf], [-1.4012985e-45, 1.0561718e+00],
                         [-1.7270355e+00, 3.4e+38]]]
    return scores


def test_sparse_table_by_address_of_shards_with_one_key_each():
    """The example the hypothesis test above waited in on an H100, pinned as one launch:
    three rows of one request of 255 tokens (two blocks), so each rank's six keys are one
    block's and five empty ones; the rank merge + table by address. Runs of eight keys
    span both ranks, so the merge finds them out of order and votes so: with Numba's
    syncthreads_or as that vote the kernel never finished (BENCHMARKS.md, "Small rows,
    2026-12-07: the rank merge's block vote")."""
    case = Case(one_key_each_scores(), np.array([255], np.int32), world=2, topk=6, query_len=3,
                global_blocks=25, init_blocks=0, local_blocks=1)
    keys = gathered_keys(case, case.topk)
    assert ((keys != 0).sum(axis=-1) == 1).all()
    table = block_table(np.random.default_rng(60523), case)
    with planned_kernels("_MERGE_LAUNCHES") as names:
        run_merge(keys, case, table=table, stride=0, addressed=True, method="auto")
    assert names == ["merge_topk_ids_and_table_addressed_rank"]


@pytest.mark.parametrize("method", ["warp", "rank"])
def test_addressed_and_array_merges_agree(method):
    """The same merge + table through both kernels of a family: the outputs match the
    oracle, and ``addressed`` picks the kernel (on by default)."""
    rng = np.random.default_rng(8)
    case = Case(rng.standard_normal((2, 3, 90)).astype(np.float32),
                np.array([90 * 128, 41 * 128 + 5, 2 * 128], np.int32), world=3, topk=12,
                query_len=1, global_blocks=90, init_blocks=1, local_blocks=2)
    keys = gathered_keys(case, case.topk)
    table = block_table(rng, case)
    names = {}
    for addressed in (None, False, True):
        with planned_kernels("_MERGE_LAUNCHES") as planned:
            run_merge(keys, case, table=table, method=method, addressed=addressed)
        (names[addressed],) = planned
    array, by_address = (f"merge_topk_ids_and_table_{method}",
                         f"merge_topk_ids_and_table_addressed_{method}")
    assert names == {None: by_address, False: array, True: by_address}


@pytest.mark.parametrize("setting, kernel", [("0", "merge_topk_ids_and_table_rank"),
                                              ("1", "merge_topk_ids_and_table_addressed_rank")])
def test_numba_cp_addressed_sets_the_default(monkeypatch, setting, kernel):
    """NUMBA_CP_ADDRESSED picks the kernel of a call that leaves ``addressed`` unset;
    an explicit keyword still wins, and the outputs match the oracle either way."""
    monkeypatch.setenv("NUMBA_CP_ADDRESSED", setting)
    rng = np.random.default_rng(9)
    case = Case(rng.standard_normal((1, 2, 40)).astype(np.float32),
                np.array([40 * 128, 17 * 128 + 3], np.int32), world=2, topk=8, query_len=1,
                global_blocks=40, init_blocks=1, local_blocks=2)
    keys, table = gathered_keys(case, case.topk), block_table(rng, case)
    names = {}
    for addressed in (None, setting == "0"):
        with planned_kernels("_MERGE_LAUNCHES") as planned:
            run_merge(keys, case, table=table, method="rank", addressed=addressed)
        (names[addressed],) = planned
    other = {"0": "merge_topk_ids_and_table_addressed_rank",
             "1": "merge_topk_ids_and_table_rank"}[setting]
    assert names == {None: kernel, setting == "0": other}


@pytest.mark.parametrize("setting", ["on", "2", "true"])
def test_a_bad_numba_cp_addressed_is_named(monkeypatch, setting):
    monkeypatch.setenv("NUMBA_CP_ADDRESSED", setting)
    case = Case(np.zeros((1, 1, 4), np.float32), np.array([512], np.int32), world=1, topk=2,
                query_len=1, global_blocks=4, init_blocks=1, local_blocks=1)
    with planned_kernels("_MERGE_LAUNCHES"), \
            pytest.raises(ValueError, match=f"NUMBA_CP_ADDRESSED must be 0 .* got '{setting}'"):
        run_merge(gathered_keys(case, 2), case,
                  table=block_table(np.random.default_rng(0), case))


@pytest.mark.parametrize("addressed", ["yes", 1, 0.0])
def test_a_bad_addressed_is_named(addressed):
    case = Case(np.zeros((1, 1, 4), np.float32), np.array([512], np.int32), world=1, topk=2,
                query_len=1, global_blocks=4, init_blocks=1, local_blocks=1)
    with pytest.raises(TypeError, match="addressed must be True, False or None"):
        run_merge(gathered_keys(case, 2), case, table=block_table(np.random.default_rng(0),
                                                                  case), addressed=addressed)


# ---------------------------------------------------------------------------
# merge_keys: the two-level exchange's first merge keeps keys


def run_merge_keys(keys, case, topk, **launch):
    out = to_device(np.full((case.heads, case.tokens, topk + 2), SENTINEL, np.int64))
    result = numba_cp.ops.merge_keys(to_device(keys), to_device(case.seq_lens), topk=topk,
                                     out=out, **launch, **case.window)
    assert result is out
    got = to_host(out)
    np.testing.assert_array_equal(
        got[:, :, :topk], ref.merge_keys(keys, case.seq_lens, topk=topk, **case.window))
    assert (got[:, :, topk:] == SENTINEL).all(), "keys written past topk"


@kernel_examples(40)
@given(case=cases(), data=st.data())
def test_merge_keys_matches_oracle(case, data):
    per_shard = data.draw(st.integers(1, case.topk + 2), label="per_shard")
    run_merge_keys(gathered_keys(case, per_shard), case, case.topk,
                   **data.draw(launches(), label="launch"))


@kernel_examples(20)
@given(case=cases(max_world=4), seed=st.integers(0, 2**32 - 1), launch=launches())
def test_merge_keys_of_garbage_matches_oracle(case, seed, launch):
    keys = garbage_keys(np.random.default_rng(seed), (case.world, case.heads, case.tokens, 4))
    run_merge_keys(keys, case, case.topk, **launch)


@kernel_examples(30)
@given(case=cases(min_world=2), data=st.data())
def test_two_merges_select_what_one_does(case, data):
    """Any grouping of the ranks into nodes: merging each node's keys into keys, then
    merging the nodes', gives the one merge's topk_idx (SPEC.md, two-level exchange)."""
    keys = gathered_keys(case, case.topk)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(case.world - 1, 1)),
                                    max_size=case.world - 1), label="node cuts"))
    groups = [g for g in np.split(np.arange(case.world), cuts) if g.size]
    launch = data.draw(launches(), label="launch")
    node_keys = []
    for group in groups:
        out = to_device(np.zeros((case.heads, case.tokens, case.topk), np.int64))
        numba_cp.ops.merge_keys(to_device(keys[group]), to_device(case.seq_lens),
                                topk=case.topk, out=out, **launch, **case.window)
        node_keys.append(to_host(out))
    run_merge(np.stack(node_keys), case, **launch)  # asserts against the one-level oracle
    np.testing.assert_array_equal(
        ref.merge_topk_keys(np.stack(node_keys), case.seq_lens, topk=case.topk,
                            **case.window),
        ref.merge_topk_keys(keys, case.seq_lens, topk=case.topk, **case.window))
