"""numba_cp.testing: its strategies, its fake world and its assert, used for real.

The fake world must agree with the oracle, catch kernels that are wrong in the
ways kernels go wrong, and the assert must point at the entry that differs;
the strategies must actually produce the inputs they promise.
"""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import numba_cp
from numba_cp.constants import INIT_SCORE, LOCAL_SCORE
from numba_cp.testing import (POISON_KEY, ExchangeCase, ExchangeResult, FakeWorld,
                              assert_exchange_exact, exchange_cases, expected_exchange,
                              score_matrix, score_rows)
from support import THREADS, to_device

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "testing.md"


def table_for(case, rng):
    return rng.integers(0, 1000, size=(case.seq_lens.size, case.global_blocks + 2),
                        dtype=np.int32)


# -- the fake world against the oracle ---------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(case=exchange_cases(max_extra_keys=2), data=st.data())
def test_fake_world_matches_the_oracle(case, data):
    launch = data.draw(st.sampled_from([dict(method="warp"),
                                        dict(method="radix", threads=THREADS)]), label="launch")
    table = (table_for(case, np.random.default_rng(case.topk))
             if data.draw(st.booleans(), label="sparse table") else None)
    result = FakeWorld(case.world, **launch).run(
        case, attention_block_table=table,
        extra_columns=data.draw(st.integers(0, 2), label="extra_columns"),
        fill=data.draw(st.sampled_from([np.inf, np.nan, 3e38]), label="fill"))
    assert (result.sparse_block_table is None) == (table is None)
    assert result.keys.shape == (case.world, case.heads, case.tokens, case.keys_per_shard)
    assert_exchange_exact(result, case.expected(attention_block_table=table),
                          seq_lens=case.seq_lens, query_len=case.query_len)
    # per_shard >= topk: the exchange equals the unsharded top-k (SPEC.md §11)
    unsharded = expected_exchange(case.full_scores, case.seq_lens, topk=case.topk,
                                  global_blocks=case.global_blocks, **case.window)
    assert unsharded.keys is None
    assert_exchange_exact(result.topk_idx, unsharded.topk_idx, what="topk_idx")


def test_shards_are_round_robin_with_fill_past_the_blocks():
    full = np.arange(2 * 3 * 10, dtype=np.float32).reshape(2, 3, 10)
    shards = FakeWorld(4).shards(full, global_blocks=10, extra_columns=1, fill=-5.0)
    assert [s.shape for s in shards] == [(2, 3, 4)] * 4
    for rank, shard in enumerate(shards):
        for column in range(4):
            block = column * 4 + rank
            want = full[:, :, block] if block < 10 else np.full((2, 3), -5.0, np.float32)
            np.testing.assert_array_equal(shard[:, :, column], want)


def fixed_case(world=3):
    """Two long requests of two query tokens; +inf past each row's window, where no
    kernel may read. No local blocks, so a kernel that reads one block too many sees
    the garbage itself rather than a block pinned in its place."""
    rng = np.random.default_rng(8)
    case = ExchangeCase(score_matrix(rng, (2, 4, 30), "normal"),
                        np.array([30 * 128, 20 * 128 + 5], np.int32), world=world, topk=12,
                        query_len=2, global_blocks=30, init_blocks=1, local_blocks=0)
    for row, valid in enumerate(case.valid_blocks):
        case.full_scores[:, row, valid:] = np.inf
    return case


def pack_dropping_last_key(scores, seq_lens, *, out, topk, **arguments):
    numba_cp.local_topk_keys(scores, seq_lens, out=out, topk=topk, **arguments)
    out[..., topk - 1] = 0


def pack_reading_past_the_window(scores, seq_lens, **arguments):
    numba_cp.local_topk_keys(scores, seq_lens + 128, **arguments)


def pack_writing_nothing(scores, seq_lens, **arguments):
    pass


def merge_missing_a_rank(keys, topk_idx, seq_lens, **arguments):
    numba_cp.merge_topk_keys(keys[:-1], topk_idx, seq_lens, **arguments)


def merge_swapping_slots(keys, topk_idx, seq_lens, **arguments):
    numba_cp.merge_topk_keys(keys, topk_idx, seq_lens, **arguments)
    topk_idx[..., [0, 1]] = topk_idx[..., [1, 0]]


def merge_leaving_the_table(keys, topk_idx, seq_lens, *, sparse_context_lens_out, **arguments):
    numba_cp.merge_topk_keys(keys, topk_idx, seq_lens,
                             sparse_context_lens_out=sparse_context_lens_out.copy(),
                             **arguments)


@pytest.mark.parametrize("kernels, world, message", [
    (dict(pack=pack_dropping_last_key), 1,
     r"topk_idx: first difference at \(head 0, row 0, slot 11\): got -1, expected"),
    (dict(pack=pack_reading_past_the_window), 3,
     r"topk_idx: first difference at \(head 0, row 2, slot 1\): got 21, expected"),
    (dict(pack=pack_writing_nothing), 3,
     r"topk_idx: first difference at \(head 0, row 0, slot 0\): got 65534, expected 0"),
    (dict(merge=merge_missing_a_rank), 3, r"topk_idx: first difference at \(head 0, row 0, "),
    (dict(merge=merge_swapping_slots), 3, r"\(head 0, row 0, slot 0\): got \d+, expected 0"),
    (dict(merge=merge_leaving_the_table), 2,
     r"sparse_context_lens: first difference at \(head 0, row 0\): got -7 \(never written\)"),
], ids=["drops-last-key", "reads-past-window", "writes-nothing", "misses-a-rank",
        "swaps-slots", "leaves-context-lens"])
def test_fake_world_catches_broken_kernels(kernels, world, message):
    case = fixed_case(world)
    table = table_for(case, np.random.default_rng(1))
    expected = case.expected(attention_block_table=table)
    good = FakeWorld(case.world).run(case, attention_block_table=table)
    assert_exchange_exact(good, expected)
    broken = FakeWorld(case.world, **kernels).run(case, attention_block_table=table)
    with pytest.raises(AssertionError, match=message):
        assert_exchange_exact(broken, expected)


def test_a_pack_that_reads_garbage_fails_on_its_keys():
    case = fixed_case(world=2)
    broken = FakeWorld(2, pack=pack_reading_past_the_window).run(case)
    with pytest.raises(AssertionError, match=r"keys: first difference at \(rank 1, head 0, "
                                             r"row 2, slot 0\): got 0x1ff8000000016 \(block 21,"
                                             r" score inf\), expected 0x1"):
        assert_exchange_exact(broken.keys, case.expected().keys, what="keys")


# -- the assert names the first difference -----------------------------------------------

def small_expected():
    case = fixed_case()
    return case, case.expected(attention_block_table=table_for(case, np.random.default_rng(2)))


@pytest.mark.parametrize("what, layout, first, later, where", [
    ("topk_idx", None, (1, 2, 3), (1, 3, 0), "head 1, row 2, slot 3"),
    ("keys", None, (2, 0, 1, 4), (2, 1, 0, 0), "rank 2, head 0, row 1, slot 4"),
    ("sparse_block_table", None, (0, 3, 17), (1, 0, 0), "head 0, row 3, column 17 = slot 2, "
                                                        "page 1"),
    ("sparse_block_table", "one-head", (2, 9), (3, 0), "row 2, column 9 = slot 1, page 1"),
    ("sparse_context_lens", None, (1, 1), (1, 3), "head 1, row 1"),
    ("sparse_context_lens", "one-head", (3,), (3,), "row 3"),
])
def test_assert_names_the_first_differing_entry(what, layout, first, later, where):
    _, expected = small_expected()
    want = getattr(expected, what)
    if layout == "one-head":
        want = want[1]
    got = want.copy()
    got[first] += 1
    if later != first:
        got[later] += 5
    count = 1 if later == first else 2
    message = (f"{what}: first difference at ({where}): got .*{int(want[first]) + 1:#x}"
               if what == "keys" else
               f"{what}: first difference at ({where}): got {int(want[first]) + 1}, expected "
               f"{int(want[first])}; {count} of {want.size} entries differ")
    with pytest.raises(AssertionError, match=re.escape(message).replace(r"\.\*", ".*")):
        assert_exchange_exact(to_device(got), to_device(want), what=what)
    assert_exchange_exact(to_device(want.copy()), want, what=what)


def test_assert_describes_the_row_and_shows_both_rows():
    case, expected = small_expected()
    got = expected.topk_idx.copy()
    got[0, 3, 5] = 99
    with pytest.raises(AssertionError) as raised:
        assert_exchange_exact(got, expected.topk_idx, seq_lens=case.seq_lens, query_len=2)
    text = str(raised.value)
    assert "row 3 is query token 1 of request 1: causal_len 2565, valid_blocks 21" in text
    assert f"got      {got[0, 3].tolist()}" in text
    assert f"expected {expected.topk_idx[0, 3].tolist()}" in text


def test_assert_compares_every_output_expected_holds():
    _, expected = small_expected()
    idx, sbt, ctx, keys = (a.copy() for a in expected)
    assert_exchange_exact((idx, sbt, ctx), ExchangeResult(idx, sbt, ctx))  # merge's tuple
    assert_exchange_exact(idx, ExchangeResult(idx))
    with pytest.raises(AssertionError, match="sparse_block_table is missing"):
        assert_exchange_exact(idx, expected)
    ctx[1, 2] += 1
    with pytest.raises(AssertionError, match=r"sparse_context_lens: first difference at "
                                             r"\(head 1, row 2\)"):
        assert_exchange_exact(ExchangeResult(idx, sbt, ctx, keys), expected)
    with pytest.raises(AssertionError, match=r"topk_idx has shape \(2, 4, 11\), expected "
                                             r"\(2, 4, 12\)"):
        assert_exchange_exact(idx[:, :, 1:], idx)
    with pytest.raises(AssertionError, match="topk_idx has dtype int64, the contract's is int32"):
        assert_exchange_exact(idx.astype(np.int64), idx)


@pytest.mark.parametrize("call, error, message", [
    (lambda e: assert_exchange_exact(e.topk_idx, e.topk_idx, what="idx"), ValueError,
     "what must be None or one of"),
    (lambda e: assert_exchange_exact(e.topk_idx, e.topk_idx[0], what="topk_idx"), ValueError,
     r"expected topk_idx must be 3-D, got shape \(4, 12\)"),
    (lambda e: assert_exchange_exact(e.topk_idx, e.topk_idx, query_len=0), ValueError,
     "query_len must be >= 1"),
    (lambda e: assert_exchange_exact(e.topk_idx, e.topk_idx, seq_lens=np.ones(2)), ValueError,
     "seq_lens must be a 1-D integer array"),
    (lambda e: assert_exchange_exact((e.topk_idx, e.keys), e), TypeError,
     "actual must be an ExchangeResult"),
    (lambda e: assert_exchange_exact(np.array(["a"]), e.topk_idx[0, 0, :1], what="topk_idx"),
     ValueError, "expected topk_idx must be 3-D"),
    (lambda e: assert_exchange_exact(np.array([[["a"]]]), e.topk_idx[:1, :1, :1],
                                     what="topk_idx"), TypeError, "actual topk_idx must be an"),
])
def test_assert_rejects_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call(small_expected()[1])


# -- the strategies produce what they promise --------------------------------------------

PINNED_LEVELS = np.array([INIT_SCORE, LOCAL_SCORE], dtype=np.float32)


def features(case):
    """The adversarial properties one case exhibits, as labels."""
    found = {f"world {case.world}"}
    valid = case.valid_blocks
    if case.query_len > 1:
        found.add("query_len > 1")
    if case.heads > 1:
        found.add("heads > 1")
    if case.world > case.global_blocks:
        found.add("a rank without blocks")
    if (valid == 0).any():
        found.add("padded row")
    if (valid > case.topk).any():
        found.add("more candidates than topk")
    if (np.minimum(valid, case.init_blocks) + np.minimum(valid, case.local_blocks)
            > case.topk).any():
        found.add("more pinned blocks than topk")
    for h in range(case.heads):
        for row in range(case.tokens):
            values = case.full_scores[h, row, :valid[row]]
            bits = values.view(np.uint32)
            nan = np.isnan(values)
            labels = {"NaN": nan & (bits < 2**31), "negative NaN": nan & (bits >= 2**31),
                      "+0": bits == 0, "-0": bits == 2**31, "+inf": values == np.inf,
                      "-inf": values == -np.inf,
                      "score at a pinned level": np.isin(values, PINNED_LEVELS)}
            found.update(label for label, hit in labels.items() if hit.any())
            if labels["+0"].any() and labels["-0"].any():
                found.add("+0 and -0 in one row")
            numbers = values[~nan]
            if np.unique(numbers).size < numbers.size:
                found.add("tie")
            # long enough that "special" scores are not all garbage-like by chance
            outside = case.full_scores[h, row, valid[row]:case.global_blocks]
            if outside.size >= 8 and (np.isnan(outside) | (outside >= 1e30)).all():
                found.add("garbage outside the window")
    return found


PROMISED = {"world 1", "world 8", "query_len > 1", "heads > 1", "a rank without blocks",
            "padded row", "more candidates than topk", "more pinned blocks than topk", "NaN",
            "negative NaN", "+0", "-0", "+0 and -0 in one row", "+inf", "-inf",
            "score at a pinned level", "tie", "garbage outside the window"}


def test_exchange_cases_produce_every_adversarial_input():
    seen = Counter()

    @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate])
    @given(case=exchange_cases())
    def collect(case):
        assert case.full_scores.dtype == np.float32 and case.seq_lens.dtype == np.int32
        assert case.tokens % case.query_len == 0 and case.per_shard is None
        assert case.full_scores.shape[2] == case.global_blocks
        seen.update(features(case))

    collect()
    missing = PROMISED - set(seen)
    assert not missing, f"never drawn in 300 cases: {sorted(missing)}; drawn: {dict(seen)}"


def test_strategy_bounds_hold():
    seen = []

    @settings(max_examples=40, deadline=None, database=None, phases=[Phase.generate])
    @given(case=exchange_cases(min_world=2, max_world=3, max_heads=1, max_requests=1,
                               max_query_len=1, max_global_blocks=5, max_topk=2,
                               max_extra_keys=3, modes=("ties",), garbage=False))
    def collect(case):
        seen.append(case)

    collect()
    assert {c.world for c in seen} == {2, 3}
    assert all(c.heads == 1 and c.tokens == 1 and c.global_blocks <= 5 for c in seen)
    assert all(c.topk <= c.keys_per_shard <= c.topk + 3 for c in seen)
    assert any(c.per_shard is not None for c in seen)
    assert all(np.isfinite(c.full_scores).all() for c in seen), "ties mode, no garbage"


def test_score_rows_draw_every_mode():
    seen = []

    @settings(max_examples=30, deadline=None, database=None, phases=[Phase.generate])
    @given(scores=score_rows((2, 3, 40)))
    def collect(scores):
        assert scores.shape == (2, 3, 40) and scores.dtype == np.float32
        seen.append(scores)

    collect()
    assert any(np.isnan(s).any() for s in seen)
    assert any((np.unique(s).size <= 5) for s in seen), "no 'ties' draw"
    assert any(np.unique(s).size == s.size for s in seen), "no 'normal' draw"


@pytest.mark.parametrize("make, error, message", [
    (lambda: exchange_cases(max_world=0), ValueError, "max_world must be >= 1, got 0"),
    (lambda: exchange_cases(min_world=3, max_world=2), ValueError, "max_world must be >= 3"),
    (lambda: exchange_cases(max_topk=4096), ValueError, "max_topk must be in"),
    (lambda: exchange_cases(max_heads=2.0), TypeError, "max_heads must be an integer"),
    (lambda: exchange_cases(max_global_blocks=65535), ValueError, "max_global_blocks"),
    (lambda: exchange_cases(max_extra_keys=-1), ValueError, "max_extra_keys"),
    (lambda: exchange_cases(modes=("ties", "odd")), ValueError, "modes must be"),
    (lambda: exchange_cases(modes="ties"), TypeError, "modes must be a tuple or list"),
    (lambda: exchange_cases(garbage="yes"), TypeError, "garbage must be a bool"),
    (lambda: score_rows([2, 3]), TypeError, "shape must be a tuple"),
    (lambda: score_rows((2, -1)), ValueError, r"shape\[1\] must be >= 0"),
    (lambda: score_matrix(np.random.default_rng(0), (2,), "odd"), ValueError, "mode must be"),
])
def test_strategies_reject_bad_bounds(make, error, message):
    with pytest.raises(error, match=message):
        make()


# -- the fake world's own arguments ------------------------------------------------------

def exchange(world=2, **change):
    case = fixed_case(world)
    arguments = dict(topk=case.topk, global_blocks=case.global_blocks, **case.window)
    arguments.update(change)
    scores = arguments.pop("full_scores", case.full_scores)
    seq_lens = arguments.pop("seq_lens", case.seq_lens)
    return FakeWorld(world).exchange(scores, seq_lens, **arguments)


@pytest.mark.parametrize("make, error, message", [
    (lambda: FakeWorld(0), ValueError, "world must be >= 1"),
    (lambda: FakeWorld(True), TypeError, "world must be an integer, got bool"),
    (lambda: FakeWorld(2, pack="local_topk_keys"), TypeError, "pack must be callable"),
    (lambda: FakeWorld(2).run(fixed_case(3)), ValueError, r"case.world \(3\) must equal"),
    (lambda: FakeWorld(2).run("case"), TypeError, "case must be an ExchangeCase"),
    (lambda: exchange(full_scores=np.zeros((4, 30), np.float32)), ValueError,
     "full_scores must be 3-D"),
    (lambda: exchange(full_scores=np.zeros((2, 4, 30))), TypeError,
     "full_scores must be float32, got float64"),
    (lambda: exchange(global_blocks=31), ValueError, r"full_scores.shape\[2\] must be >= "
                                                     "global_blocks"),
    (lambda: exchange(query_len=3), ValueError, "must be a multiple of query_len"),
    (lambda: exchange(seq_lens=np.ones(1, np.int32)), ValueError, "seq_lens must be 1-D"),
    (lambda: exchange(seq_lens=np.ones(2, np.float32)), TypeError, "seq_lens must have an "
                                                                   "integer dtype"),
    (lambda: exchange(topk=0), ValueError, "topk must be in"),
    (lambda: exchange(per_shard=2.5), TypeError, "per_shard must be an integer"),
    (lambda: exchange(block_page_stride=8), ValueError, "block_page_stride is given without"),
    (lambda: exchange(attention_block_table=np.zeros((2, 30))), TypeError,
     "attention_block_table must be int32"),
    (lambda: exchange(attention_block_table=np.zeros(30, np.int32)), ValueError,
     "attention_block_table must be 2-D"),
    (lambda: exchange(fill="nan"), TypeError, "fill must be a real number"),
    (lambda: exchange(extra_columns=-1), ValueError, "extra_columns must be >= 0"),
])
def test_fake_world_rejects_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_expected_exchange_rejects_shards_without_a_world():
    case = fixed_case()
    with pytest.raises(ValueError, match="per_shard is given without world"):
        expected_exchange(case.full_scores, case.seq_lens, topk=12, per_shard=14,
                          global_blocks=30, **case.window)
    with pytest.raises(ValueError, match="world must be >= 1"):
        expected_exchange(case.full_scores, case.seq_lens, topk=12, world=0,
                          global_blocks=30, **case.window)


def test_poisoned_outputs_decode_as_never_written():
    case = fixed_case(world=2)
    keys = case.expected().keys.copy()
    want = keys.copy()
    keys[1, 1, 0, 3] = POISON_KEY
    with pytest.raises(AssertionError, match=r"\(rank 1, head 1, row 0, slot 3\): got "
                                             r"0x1ffffffffffff \(never written\)"):
        assert_exchange_exact(keys, want, what="keys")


# -- hypothesis is optional; the documented example runs -----------------------------------

def test_imports_without_hypothesis_and_says_what_to_install():
    script = (
        "import sys\n"
        "sys.modules['hypothesis'] = None\n"  # what an uninstalled package looks like
        "import numpy as np\n"
        "from numba_cp.testing import FakeWorld, assert_exchange_exact, exchange_cases\n"
        "assert_exchange_exact(np.zeros((1, 1, 1), np.int32), np.zeros((1, 1, 1), np.int32))\n"
        "try:\n"
        "    exchange_cases()\n"
        "except ImportError as error:\n"
        "    print('ImportError:', error)\n")
    env = dict(os.environ, NUMBA_CP_BACKEND="sim",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ImportError: numba_cp.testing's strategies need hypothesis" in done.stdout
    assert "pip install hypothesis" in done.stdout


def test_the_documented_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/testing.md should hold exactly one python example"
    namespace = {"__name__": "docs_testing_example"}
    exec(compile(blocks[0], str(DOCS), "exec"), namespace)
    tests = [value for name, value in namespace.items() if name.startswith("test_")]
    assert tests, "the example defines no test"
    for test in tests:
        test()
