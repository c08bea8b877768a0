"""Tools for testing an exchange kernel of your own against the contract.

Three pieces, the ones numba_cp's own tests use (``docs/testing.md`` has an
example test):

* hypothesis strategies for adversarial cases: :func:`exchange_cases` draws a
  whole :class:`ExchangeCase` (scores with ties, NaN of either sign, ``-0.0``,
  ``+-inf`` and scores at the pinned levels; padded rows; garbage past each
  row's window; ``query_len > 1``; world 1..8) and :func:`score_rows` just the
  scores;
* :class:`FakeWorld`, an exchange over ``world`` shards in one process, with no
  MPI: pack every rank's round-robin shard, stack the keys as the all-gather
  delivers them, merge; the pack and merge are the package's kernels on the
  active backend unless you pass your own;
* :func:`assert_exchange_exact`, which compares results with the oracle's and
  names the first differing ``(head, row, slot)`` and both values.

hypothesis is optional: this module imports without it, and only the
strategies need it.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import reference as ref
from . import validate
from .arrays import device_copy, host_copy
from .constants import (MAX_GLOBAL_BLOCKS, MAX_PAGE_STRIDE, MAX_PINNED, MAX_TOPK, PAGES,
                        SPARSE_BLOCK)
from .ops import local_topk_keys, merge_topk_keys

__all__ = ["SPECIAL_SCORES", "GARBAGE_SCORES", "SCORE_MODES", "ExchangeCase", "ExchangeResult",
           "exchange_cases", "score_rows", "score_matrix", "seq_len_choices",
           "expected_exchange", "FakeWorld", "assert_exchange_exact", "POISON_KEY",
           "POISON_INT32"]

# Scores where bit-level mistakes show: NaN of both signs, both zeros, both
# infinities, the two pinned levels (and -1e30), denormals, float32 max.
SPECIAL_SCORES = np.array(
    [np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1e30, 1e29, -1e30, 1e-45, -1e-45, 1.0, -1.0,
     3.4e38], dtype=np.float32)

# What columns outside a row's window hold: values that would win (or NaN, which
# a careless comparison mishandles) if a kernel read them.
GARBAGE_SCORES = np.array([np.inf, np.nan, 3.4e38, 1e30], dtype=np.float32)

SCORE_MODES = ("normal", "ties", "special")


def score_matrix(rng, shape, mode):
    """float32 scores of ``shape`` from ``rng``, by ``mode``.

    ``"normal"``: standard normal; ``"ties"``: a few distinct integers, so that
    most scores tie; ``"special"``: about half of them from :data:`SPECIAL_SCORES`.
    """
    if mode not in SCORE_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, SCORE_MODES))}, "
                         f"got {mode!r}")
    if mode == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if mode == "ties":
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    special = rng.random(shape) < 0.5
    values[special] = rng.choice(SPECIAL_SCORES, size=int(special.sum()))
    return values


def seq_len_choices(rng, requests, query_len, global_blocks):
    """int32 context lengths mixing padded rows, block edges and lengths past the blocks.

    Lengths of ``query_len - 1`` or less leave some or all of a request's rows
    with no valid block (padded rows, SPEC.md §3).
    """
    horizon = (global_blocks + 2) * SPARSE_BLOCK
    pool = [-3, 0, 1, max(query_len - 1, 0), query_len, SPARSE_BLOCK, SPARSE_BLOCK + 1,
            2 * SPARSE_BLOCK - 1, horizon]
    out = []
    for _ in range(requests):
        if rng.random() < 0.4:
            out.append(int(rng.choice(pool)))
        else:
            out.append(int(rng.integers(1, horizon + 1)))
    return np.array(out, dtype=np.int32)


def _row_valid_blocks(seq_lens, tokens, query_len, global_blocks):
    valid = np.zeros(tokens, dtype=np.int64)
    for row in range(tokens):
        _, blocks, _ = ref.row_window(seq_lens[row // query_len], row % query_len,
                                      query_len=query_len, local_blocks=0)
        valid[row] = min(blocks, global_blocks)
    return valid


@dataclass
class ExchangeCase:
    """One exchange problem: full-context scores and everything the ranks agree on.

    ``full_scores[h, row, g]`` is the score of global block ``g``; columns at or
    past a row's valid blocks are never used and may hold anything.
    ``per_shard`` (default ``topk``) is each rank's key count.
    """

    full_scores: np.ndarray  # float32 [heads, tokens, global_blocks]
    seq_lens: np.ndarray  # int32 [requests]
    world: int
    topk: int
    query_len: int
    global_blocks: int
    init_blocks: int
    local_blocks: int
    per_shard: int | None = None

    @property
    def window(self):
        """The row-window arguments both kernels take."""
        return dict(query_len=self.query_len, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks)

    @property
    def shard_args(self):
        """The window plus what :func:`numba_cp.local_topk_keys` also needs, but ``rank``."""
        return dict(self.window, global_blocks=self.global_blocks, world=self.world)

    @property
    def heads(self):
        return self.full_scores.shape[0]

    @property
    def tokens(self):
        return self.full_scores.shape[1]

    @property
    def keys_per_shard(self):
        return self.topk if self.per_shard is None else self.per_shard

    @property
    def valid_blocks(self):
        """int64 ``[tokens]``: each row's candidate blocks, SPEC.md's ``valid_blocks``
        capped at ``global_blocks`` (0 for a padded row)."""
        return _row_valid_blocks(self.seq_lens, self.tokens, self.query_len, self.global_blocks)

    def expected(self, *, attention_block_table=None, block_page_stride=None):
        """What any exact exchange of this case returns (:func:`expected_exchange`)."""
        return expected_exchange(
            self.full_scores, self.seq_lens, world=self.world, topk=self.topk,
            per_shard=self.per_shard, global_blocks=self.global_blocks,
            attention_block_table=attention_block_table,
            block_page_stride=block_page_stride, **self.window)


class ExchangeResult(NamedTuple):
    """Host copies of an exchange's outputs; a field that was not produced is None."""

    topk_idx: np.ndarray  # int32 [heads, tokens, topk]
    sparse_block_table: np.ndarray | None = None  # int32 [heads, tokens, topk * 8]
    sparse_context_lens: np.ndarray | None = None  # int32 [heads, tokens]
    keys: np.ndarray | None = None  # int64 [world, heads, tokens, per_shard], as gathered


# -- hypothesis strategies ---------------------------------------------------------------

def _strategies():
    try:
        from hypothesis import strategies
    except ImportError:
        raise ImportError("numba_cp.testing's strategies need hypothesis, which is not "
                          "installed: pip install hypothesis") from None
    return strategies


def _modes(modes):
    if isinstance(modes, str) or not isinstance(modes, (tuple, list)):
        raise TypeError(f"modes must be a tuple or list of {SCORE_MODES}, "
                        f"got {type(modes).__name__} {modes!r}")
    unknown = [m for m in modes if m not in SCORE_MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty selection of {SCORE_MODES}, got {modes!r}")
    return tuple(modes)


def score_rows(shape, *, modes=SCORE_MODES):
    """A strategy for float32 scores of ``shape`` in one of ``modes`` (:func:`score_matrix`).

    The values come from a drawn seed, so hypothesis shrinks the mode and the
    seed, not single scores; that keeps large rows cheap to draw.
    """
    if not isinstance(shape, tuple):
        raise TypeError(f"shape must be a tuple of integers, got {type(shape).__name__}")
    shape = tuple(validate.integer(f"shape[{i}]", n, low=0) for i, n in enumerate(shape))
    modes = _modes(modes)
    st = _strategies()
    return st.builds(lambda mode, seed: score_matrix(np.random.default_rng(seed), shape, mode),
                     st.sampled_from(modes), st.integers(0, 2**32 - 1))


def exchange_cases(*, min_world=1, max_world=8, max_heads=2, max_requests=3, max_query_len=3,
                   max_global_blocks=48, max_topk=12, max_extra_keys=0, modes=SCORE_MODES,
                   garbage=True):
    """A strategy for :class:`ExchangeCase`: small, adversarial exchange problems.

    Every size is drawn from 1 (0 for ``global_blocks``) up to its ``max_``
    bound; ``init_blocks`` and ``local_blocks`` from 0..3, so that the pinned
    blocks sometimes outnumber ``topk``. Scores follow one of ``modes``
    (:func:`score_matrix`), context lengths :func:`seq_len_choices` (padded
    rows, block edges, lengths past ``global_blocks``). With ``garbage``, most
    cases fill every column outside a row's window with
    :data:`GARBAGE_SCORES`, which a kernel that reads them cannot hide.
    ``per_shard`` is ``topk`` plus 0..``max_extra_keys``, so the exchange stays
    exact.
    """
    min_world = validate.integer("min_world", min_world, low=1)
    max_world = validate.integer("max_world", max_world, low=min_world)
    max_heads = validate.integer("max_heads", max_heads, low=1)
    max_requests = validate.integer("max_requests", max_requests, low=1)
    max_query_len = validate.integer("max_query_len", max_query_len, low=1)
    max_global_blocks = validate.integer("max_global_blocks", max_global_blocks, low=0,
                                         high=MAX_GLOBAL_BLOCKS)
    max_topk = validate.integer("max_topk", max_topk, low=1, high=MAX_TOPK + 1)
    max_extra_keys = validate.integer("max_extra_keys", max_extra_keys, low=0,
                                      high=MAX_TOPK - max_topk + 1)
    modes = _modes(modes)
    if not isinstance(garbage, (bool, np.bool_)):
        raise TypeError(f"garbage must be a bool, got {type(garbage).__name__} {garbage!r}")
    st = _strategies()

    @st.composite
    def build(draw):
        world = draw(st.integers(min_world, max_world))
        heads = draw(st.integers(1, max_heads))
        requests = draw(st.integers(1, max_requests))
        query_len = draw(st.integers(1, max_query_len))
        global_blocks = draw(st.integers(0, max_global_blocks))
        topk = draw(st.integers(1, max_topk))
        per_shard = topk + draw(st.integers(0, max_extra_keys))
        init_blocks = draw(st.integers(0, 3))
        local_blocks = draw(st.integers(0, 3))
        mode = draw(st.sampled_from(modes))
        fill = garbage and draw(st.integers(0, 3)) > 0
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        tokens = requests * query_len
        scores = score_matrix(rng, (heads, tokens, global_blocks), mode)
        seq_lens = seq_len_choices(rng, requests, query_len, global_blocks)
        if fill:
            valid = _row_valid_blocks(seq_lens, tokens, query_len, global_blocks)
            outside = np.arange(global_blocks)[None, :] >= valid[:, None]  # [tokens, blocks]
            outside = np.broadcast_to(outside, scores.shape)
            scores[outside] = rng.choice(GARBAGE_SCORES, size=int(outside.sum()))
        return ExchangeCase(scores, seq_lens, world=world, topk=topk, query_len=query_len,
                            global_blocks=global_blocks, init_blocks=init_blocks,
                            local_blocks=local_blocks,
                            per_shard=None if per_shard == topk else per_shard)

    return build()


# -- the oracle and the fake world -------------------------------------------------------

def _full_scores(full_scores):
    full_scores = _host_array(full_scores, "full_scores")
    if full_scores.ndim != 3:
        raise ValueError(f"full_scores must be 3-D [heads, tokens, global_blocks], "
                         f"got shape {full_scores.shape}")
    if full_scores.dtype != np.float32:
        raise TypeError(f"full_scores must be float32, got {full_scores.dtype.name}")
    return full_scores


def _check_problem(full_scores, seq_lens, *, world, topk, per_shard, query_len, global_blocks,
                   init_blocks, local_blocks, attention_block_table, block_page_stride):
    """Host checks of an exchange problem, so that your kernels see only valid calls."""
    world = validate.integer("world", world, low=1)
    topk = validate.integer("topk", topk, low=1, high=MAX_TOPK + 1)
    per_shard = topk if per_shard is None else validate.integer(
        "per_shard", per_shard, low=1, high=MAX_TOPK + 1)
    query_len = validate.integer("query_len", query_len, low=1)
    global_blocks = validate.integer("global_blocks", global_blocks, low=0,
                                     high=MAX_GLOBAL_BLOCKS)
    validate.integer("init_blocks", init_blocks, low=0, high=MAX_PINNED + 1)
    validate.integer("local_blocks", local_blocks, low=0, high=MAX_PINNED + 1)
    full_scores = _full_scores(full_scores)
    heads, tokens, width = full_scores.shape
    if width < global_blocks:
        raise ValueError(f"full_scores.shape[2] must be >= global_blocks ({global_blocks}), "
                         f"got shape {full_scores.shape}")
    if tokens % query_len:
        raise ValueError(f"full_scores.shape[1] (tokens, {tokens}) must be a multiple of "
                         f"query_len ({query_len})")
    seq_lens = _host_array(seq_lens, "seq_lens")
    if seq_lens.ndim != 1 or seq_lens.shape[0] < tokens // query_len:
        raise ValueError(f"seq_lens must be 1-D with at least tokens // query_len = "
                         f"{tokens // query_len} entries, got shape {seq_lens.shape}")
    if seq_lens.dtype.kind not in "iu":
        raise TypeError(f"seq_lens must have an integer dtype, got {seq_lens.dtype.name}")
    if block_page_stride is not None:
        validate.integer("block_page_stride", block_page_stride, low=0,
                         high=MAX_PAGE_STRIDE + 1)
        if attention_block_table is None:
            raise ValueError("block_page_stride is given without attention_block_table")
    if attention_block_table is not None:
        table = _host_array(attention_block_table, "attention_block_table")
        if table.ndim != 2 or table.shape[0] < tokens // query_len:
            raise ValueError(f"attention_block_table must be 2-D [requests, max_blocks] with "
                             f"at least {tokens // query_len} rows, got shape {table.shape}")
        if table.dtype != np.int32:
            raise TypeError(f"attention_block_table must be int32, got {table.dtype.name}")
        attention_block_table = table
    return (full_scores, seq_lens, world, topk, per_shard, query_len, global_blocks,
            attention_block_table)


def expected_exchange(full_scores, seq_lens, *, topk, query_len, global_blocks, init_blocks,
                      local_blocks, world=None, per_shard=None, attention_block_table=None,
                      block_page_stride=None) -> ExchangeResult:
    """The oracle's :class:`ExchangeResult` for full-context scores.

    Without ``world``: the top-k over the unsharded rows (SPEC.md §11), and no
    keys. With ``world``: also every rank's keys, stacked as gathered, and the
    merge of those keys, which is the unsharded top-k whenever
    ``per_shard >= topk``. With ``attention_block_table``: the per-head sparse
    block table and context lengths of that top-k.
    """
    if world is None and per_shard is not None:
        raise ValueError("per_shard is given without world; the unsharded top-k has no shards")
    (full_scores, seq_lens, checked_world, topk, per_shard, query_len, global_blocks,
     table) = _check_problem(
        full_scores, seq_lens, world=1 if world is None else world, topk=topk,
        per_shard=per_shard, query_len=query_len, global_blocks=global_blocks,
        init_blocks=init_blocks, local_blocks=local_blocks,
        attention_block_table=attention_block_table, block_page_stride=block_page_stride)
    window = dict(query_len=query_len, init_blocks=init_blocks, local_blocks=local_blocks)
    keys = None
    if world is None:
        topk_idx = ref.global_topk(full_scores, seq_lens, topk=topk,
                                   global_blocks=global_blocks, **window)
    else:
        keys = np.stack([
            ref.local_topk_keys(
                ref.shard_scores(full_scores, rank=r, world=checked_world,
                                 global_blocks=global_blocks),
                seq_lens, topk=per_shard, rank=r, world=checked_world,
                global_blocks=global_blocks, **window)
            for r in range(checked_world)])
        topk_idx = ref.merge_topk_keys(keys, seq_lens, topk=topk, **window)
    if table is None:
        return ExchangeResult(topk_idx, keys=keys)
    sbt, ctx = ref.sparse_block_table(topk_idx, seq_lens, table, query_len=query_len,
                                      block_page_stride=block_page_stride)
    return ExchangeResult(topk_idx, sbt, ctx, keys)


# Outputs start out holding these, so that an entry a kernel forgets to write
# cannot pass for a correct 0 or -1. The key names block 65534, past any
# global_blocks and so past every row's local_start: a merge that sees it pins
# it as a local block and selects it, and the result shows block 65534.
POISON_KEY = (1 << 48) | (0xFFFFFFFF << 16) | 0xFFFF
POISON_INT32 = -7


class FakeWorld:
    """A CP exchange over ``world`` ranks in one process, with no MPI.

    Rank ``r``'s shard is columns ``r, r + world, ...`` of the full scores
    (SPEC.md §4); every rank packs its shard into its slice of the gathered
    keys, which is what the all-gather would deliver, and one merge reads them
    all. ``pack`` and ``merge`` default to :func:`numba_cp.local_topk_keys` and
    :func:`numba_cp.merge_topk_keys`, run with ``method``, ``threads`` and
    ``sort_limit``; pass your own callables with the same signatures (the
    keyword arguments of SPEC.md §7 and §8, outputs written in place) to test
    them. Arrays reach them where the active backend's kernels read them:
    NumPy under the simulator, CuPy on a GPU.
    """

    def __init__(self, world, *, pack=None, merge=None, method="auto", threads=None,
                 sort_limit=None):
        self.world = validate.integer("world", world, low=1)
        for name, value in (("pack", pack), ("merge", merge)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        launch = dict(method=method, threads=threads, sort_limit=sort_limit)
        self.pack = pack or functools.partial(local_topk_keys, **launch)
        self.merge = merge or functools.partial(merge_topk_keys, **launch)

    def __repr__(self):
        return f"FakeWorld({self.world})"

    def shards(self, full_scores, *, global_blocks, extra_columns=0, fill=np.inf):
        """Every rank's shard ``[heads, tokens, local]`` (host arrays).

        ``local`` is ``ceil(global_blocks / world) + extra_columns``; columns
        past ``global_blocks`` hold ``fill``, which never changes a correct kernel's result.
        """
        global_blocks = validate.integer("global_blocks", global_blocks, low=0,
                                         high=MAX_GLOBAL_BLOCKS)
        extra_columns = validate.integer("extra_columns", extra_columns, low=0)
        full_scores = _full_scores(full_scores)
        if full_scores.shape[2] < global_blocks:
            raise ValueError(f"full_scores.shape[2] must be >= global_blocks ({global_blocks}), "
                             f"got shape {full_scores.shape}")
        if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, numbers.Real):
            raise TypeError(f"fill must be a real number, got {type(fill).__name__} {fill!r}")
        fill = np.float32(fill)
        local = -(-global_blocks // self.world) + extra_columns
        return [ref.shard_scores(full_scores, rank=r, world=self.world,
                                 global_blocks=global_blocks, local=local, fill=fill)
                for r in range(self.world)]

    def exchange(self, full_scores, seq_lens, *, topk, query_len, global_blocks, init_blocks,
                 local_blocks, per_shard=None, attention_block_table=None,
                 block_page_stride=None, extra_columns=0, fill=np.inf) -> ExchangeResult:
        """pack on every shard -> gathered keys -> merge; host copies of every output.

        With ``attention_block_table`` the merge also writes the per-head
        sparse block table. ``extra_columns`` and ``fill`` widen the shards
        with columns no kernel may read (:meth:`shards`).
        """
        (full_scores, seq_lens, _, topk, per_shard, query_len, global_blocks,
         table) = _check_problem(
            full_scores, seq_lens, world=self.world, topk=topk, per_shard=per_shard,
            query_len=query_len, global_blocks=global_blocks, init_blocks=init_blocks,
            local_blocks=local_blocks, attention_block_table=attention_block_table,
            block_page_stride=block_page_stride)
        window = dict(query_len=query_len, init_blocks=init_blocks, local_blocks=local_blocks)
        heads, tokens, _ = full_scores.shape
        shards = self.shards(full_scores, global_blocks=global_blocks,
                             extra_columns=extra_columns, fill=fill)
        lens = device_copy(seq_lens)
        gathered = device_copy(np.full((self.world, heads, tokens, per_shard), POISON_KEY,
                                       np.int64))
        for rank, shard in enumerate(shards):
            self.pack(device_copy(shard), lens, topk=per_shard, rank=rank, world=self.world,
                      global_blocks=global_blocks, out=gathered[rank], **window)
        topk_idx = device_copy(np.full((heads, tokens, topk), POISON_INT32, np.int32))
        outputs = {}
        if table is not None:
            outputs = dict(
                attention_block_table=device_copy(table),
                sparse_block_table_out=device_copy(
                    np.full((heads, tokens, topk * PAGES), POISON_INT32, np.int32)),
                sparse_context_lens_out=device_copy(
                    np.full((heads, tokens), POISON_INT32, np.int32)),
                block_page_stride=block_page_stride)
        self.merge(gathered, topk_idx, lens, **window, **outputs)
        if table is None:
            return ExchangeResult(host_copy(topk_idx), keys=host_copy(gathered))
        return ExchangeResult(host_copy(topk_idx), host_copy(outputs["sparse_block_table_out"]),
                              host_copy(outputs["sparse_context_lens_out"]),
                              host_copy(gathered))

    def run(self, case, *, attention_block_table=None, block_page_stride=None,
            extra_columns=0, fill=np.inf) -> ExchangeResult:
        """:meth:`exchange` on an :class:`ExchangeCase` of this world size."""
        if not isinstance(case, ExchangeCase):
            raise TypeError(f"case must be an ExchangeCase, got {type(case).__name__}")
        if case.world != self.world:
            raise ValueError(f"case.world ({case.world}) must equal this FakeWorld's world "
                             f"({self.world})")
        return self.exchange(case.full_scores, case.seq_lens, topk=case.topk,
                             per_shard=case.per_shard, global_blocks=case.global_blocks,
                             attention_block_table=attention_block_table,
                             block_page_stride=block_page_stride,
                             extra_columns=extra_columns, fill=fill, **case.window)


# -- exact comparison ----------------------------------------------------------------------

# Axis names of each output, by its number of dimensions; the one-head sparse
# table layout (SPEC.md §9.1) is the per-head one without its head axis.
_AXES = {
    "topk_idx": {3: ("head", "row", "slot")},
    "keys": {4: ("rank", "head", "row", "slot"), 3: ("head", "row", "slot")},
    "sparse_block_table": {3: ("head", "row", "column"), 2: ("row", "column")},
    "sparse_context_lens": {2: ("head", "row"), 1: ("row",)},
}
_DTYPES = {"topk_idx": np.int32, "keys": np.int64, "sparse_block_table": np.int32,
           "sparse_context_lens": np.int32}


def _host_array(value, name):
    if value is None:
        raise TypeError(f"{name} must be an array, got None")
    if isinstance(value, np.ndarray):
        array = value
    elif (hasattr(value, "__cuda_array_interface__") or hasattr(value, "copy_to_host")
          or hasattr(value, "get")):
        array = host_copy(value)
    else:
        try:
            array = np.asarray(value)
        except Exception as exc:  # ragged lists, say
            raise TypeError(f"{name} must be an array, got {type(value).__name__} "
                            f"({exc})") from None
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be an integer or float array, got dtype "
                        f"{array.dtype.name}")
    return array


def _as_result(value, name):
    if isinstance(value, ExchangeResult):
        return value
    # A tuple of arrays is a result, as the merge returns it; nested lists are one array.
    if isinstance(value, tuple) and value and all(v is None or hasattr(v, "shape")
                                                  for v in value):
        if len(value) not in (3, 4):
            raise TypeError(f"{name} must be an ExchangeResult, a (topk_idx, sbt, ctx) tuple "
                            f"or a topk_idx array, got a tuple of {len(value)} arrays")
        return ExchangeResult(*value)
    return ExchangeResult(value)


def _describe(what, value):
    if what != "keys":
        return str(int(value)) + (" (never written)" if value == POISON_INT32 else "")
    if value == 0:
        return "0 (absent)"
    if value == POISON_KEY:
        return f"{POISON_KEY:#x} (never written)"
    block, score = ref.unpack_keys(np.array([value], np.int64))
    return f"{int(value):#x} (block {int(block[0])}, score {score[0]})"


def _row_note(row, seq_lens, query_len):
    request, t = divmod(row, query_len)
    if request >= len(seq_lens):
        return ""
    causal_len, valid_blocks, _ = ref.row_window(seq_lens[request], t, query_len=query_len,
                                                 local_blocks=0)
    return (f"\n  row {row} is query token {t} of request {request}: causal_len {causal_len}, "
            f"valid_blocks {valid_blocks}")


def _compare(actual, expected, what, seq_lens, query_len):
    expected = _host_array(expected, f"expected {what}")
    axes = _AXES[what].get(expected.ndim)
    if axes is None:
        dims = " or ".join(f"{n}-D" for n in _AXES[what])
        raise ValueError(f"expected {what} must be {dims}, got shape {expected.shape}")
    if actual is None:
        raise AssertionError(f"{what} is missing from the actual result")
    actual = _host_array(actual, f"actual {what}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what} has shape {actual.shape}, expected {expected.shape}")
    if actual.dtype != _DTYPES[what]:
        raise AssertionError(f"{what} has dtype {actual.dtype.name}, the contract's is "
                             f"{np.dtype(_DTYPES[what]).name}")
    differ = actual != expected
    if not differ.any():
        return
    first = tuple(int(i) for i in np.argwhere(differ)[0])
    where = ", ".join(f"{axis} {i}" for axis, i in zip(axes, first))
    if axes[-1] == "column":
        where += f" = slot {first[-1] // PAGES}, page {first[-1] % PAGES}"
    message = (f"{what}: first difference at ({where}): got {_describe(what, actual[first])}, "
               f"expected {_describe(what, expected[first])}; {int(differ.sum())} of "
               f"{differ.size} entries differ")
    if "row" in axes and seq_lens is not None:
        message += _row_note(first[axes.index("row")], seq_lens, query_len)
    if axes[-1] in ("slot", "column"):
        line = first[:-1]
        show = (lambda row: [hex(k) for k in row.tolist()]) if what == "keys" else np.ndarray.tolist
        message += (f"\n  got      {show(actual[line])}"
                    f"\n  expected {show(expected[line])}")
    raise AssertionError(message)


def assert_exchange_exact(actual, expected, *, what=None, seq_lens=None, query_len=1):
    """Raise AssertionError unless ``actual`` equals ``expected`` exactly.

    With ``what=None`` both are exchange results: an :class:`ExchangeResult`, a
    ``(topk_idx, sbt, ctx)`` tuple as :class:`~numba_cp.CandidateExchange` and
    :func:`numba_cp.reference.merge_topk_keys` return, or a bare ``topk_idx``.
    Every output that ``expected`` holds is compared: ``topk_idx``, then the
    sparse block table and context lengths, then the gathered keys. With
    ``what`` one of ``"topk_idx"``, ``"sparse_block_table"`` (per-head or
    one-head layout), ``"sparse_context_lens"`` or ``"keys"`` (gathered, or one
    rank's), both are arrays of that output; host or device arrays alike.

    The message names the first differing entry, e.g. ``(head 1, row 3, slot
    2)``, both values (keys decoded into block and score), how many entries
    differ, and both rows of that entry. Given ``seq_lens`` (and
    ``query_len``), it also says which request and window the row has.
    """
    if what is not None and what not in _AXES:
        raise ValueError(f"what must be None or one of {', '.join(map(repr, _AXES))}, "
                         f"got {what!r}")
    query_len = validate.integer("query_len", query_len, low=1)
    if seq_lens is not None:
        seq_lens = _host_array(seq_lens, "seq_lens")
        if seq_lens.ndim != 1 or seq_lens.dtype.kind not in "iu":
            raise ValueError(f"seq_lens must be a 1-D integer array, got shape "
                             f"{seq_lens.shape} of {seq_lens.dtype.name}")
    if what is not None:
        _compare(actual, expected, what, seq_lens, query_len)
        return
    actual = _as_result(actual, "actual")
    expected = _as_result(expected, "expected")
    for field in ("topk_idx", "sparse_block_table", "sparse_context_lens", "keys"):
        wanted = getattr(expected, field)
        if wanted is not None:
            _compare(getattr(actual, field), wanted, field, seq_lens, query_len)
