"""Public host wrappers: validate, pick a launch shape, launch. Nothing else.

Both functions are graph safe: with the output buffers given they allocate
nothing on the device, copy nothing to the host and decide only from shapes
and keyword arguments (SPEC.md, "Graph safety"). Validation runs once per
argument signature (dtypes, shapes, strides, scalars); see :mod:`.launcher`.
"""

from __future__ import annotations

from . import validate
from .arrays import as_kernel_array, with_leading_axis
from .backend import is_simulator
from .constants import MAX_GLOBAL_BLOCKS, MAX_TOPK, PAGES
from .kernels.primitives import WARP_LANES
from .kernels.topk import (merge_sparse_table_kernel, merge_sparse_table_warp_kernel,
                           merge_topk_kernel, merge_topk_warp_kernel, shard_topk_kernel,
                           shard_topk_warp_kernel)
from .launcher import KernelLaunch, LaunchCache

__all__ = ["local_topk_keys", "merge_topk_keys", "METHODS", "DEFAULT_THREADS",
           "DEFAULT_SORT_LIMIT"]

# "warp": warps sort in registers (numba_cp.kernels.warp_select), for topk up to
# WARP_LANES * MAX_LANE_SLOTS; "radix": block-wide radix select + shared-memory
# sort (numba_cp.kernels.select), for any topk; "auto": warp where it fits.
METHODS = ("auto", "warp", "radix")
MAX_LANE_SLOTS = 16  # keys per lane per pass: 3 register arrays of this many int64
# Defaults of the warp method: keys per lane per pass (more when a run needs
# them), and the most warps per row. In the H200 launch sweeps (BENCHMARKS.md)
# 2 keys per lane was the best or within 0.1 us of it in every case, and 8 warps
# beat 16 and 32. The simulator caps rows at two warps, so that the tests run
# both chunked rows and the cross-warp tree.
WARP_SLOTS = 2
WARP_MAX_WARPS = 2 if is_simulator else 8

# The simulator runs every GPU thread as a Python thread: small blocks keep it quick.
DEFAULT_THREADS = 8 if is_simulator else 128
# The most keys a row sorts (never fewer than topk): rows with more candidates
# are radix-selected until the survivors fit, then sorted. A tile above topk
# saves radix passes; a smaller one saves sort stages. On the H200 a tile of
# max(64, 2 * topk) was the best or within a few percent of it for every case of
# the benchmark's launch sweep (BENCHMARKS.md); the simulator keeps 64 so
# that the tests take both paths.
DEFAULT_SORT_LIMIT = 64


# A merge row of up to this many candidates was fastest sorted outright.
MERGE_SORT_ALL = 256


def default_sort_limit(topk: int, candidates: int, merge: bool) -> int:
    if is_simulator:
        return DEFAULT_SORT_LIMIT
    if merge and candidates <= MERGE_SORT_ALL:
        return MERGE_SORT_ALL
    return max(DEFAULT_SORT_LIMIT, 2 * topk)


_SHARD_LAUNCHES = LaunchCache()
_MERGE_LAUNCHES = LaunchCache()


class _NoWork:
    """The launch for an empty grid (no heads or no tokens)."""

    def __call__(self, objects, stream=None, pointers=None):
        return None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _method(method, topk):
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    fits = _next_pow2(topk) <= WARP_LANES * MAX_LANE_SLOTS
    if method == "warp" and not fits:
        raise ValueError(f"method='warp' handles topk <= {WARP_LANES * MAX_LANE_SLOTS} on this "
                         f"target, got topk={topk}; use method='radix' or 'auto'")
    if method != "auto":
        return method
    return "warp" if fits else "radix"


def _warp_shape(topk: int, candidates: int, threads, sort_limit):
    """``(run, slots, warps)``: the sorted run, keys per lane per pass, warps per row."""
    run = _next_pow2(topk)
    least = max(1, run // WARP_LANES)  # a run must fit in one warp
    if sort_limit is None:
        slots = max(least, min(WARP_SLOTS, _next_pow2(-(-candidates // WARP_LANES))))
    else:
        sort_limit = validate.integer("sort_limit", sort_limit, low=1,
                                      high=WARP_LANES * MAX_LANE_SLOTS + 1)
        slots = max(least, _next_pow2(-(-sort_limit // WARP_LANES)))
    if threads is None:
        warps = min(WARP_MAX_WARPS, _next_pow2(-(-candidates // (WARP_LANES * slots))))
    else:
        threads = validate.integer("threads", threads, low=1, high=1025)
        warps = threads // WARP_LANES
        if threads % WARP_LANES or warps & (warps - 1):
            raise ValueError(f"threads must be a power-of-two number of whole warps "
                             f"({WARP_LANES} lanes each) for method='warp', got {threads}")
    return run, slots, warps


def _launch_shape(topk: int, candidates: int, threads, sort_limit, merge=False):
    threads = DEFAULT_THREADS if threads is None else validate.integer(
        "threads", threads, low=1, high=1025)
    if sort_limit is None:
        sort_limit = default_sort_limit(topk, candidates, merge)
    else:
        sort_limit = validate.integer("sort_limit", sort_limit, low=1, high=MAX_TOPK + 1)
    capacity = _next_pow2(max(topk, min(candidates, sort_limit)))
    return threads, capacity


def local_topk_keys(scores, seq_lens, *, topk, rank, world, query_len, global_blocks,
                    init_blocks, local_blocks, out, stream=None, method="auto", threads=None,
                    sort_limit=None):
    """Per-head top-k packed keys of this rank's shard (SPEC.md ``local_topk_keys``).

    Args:
        scores: float32 ``[heads, tokens, local]``, this rank's shard: column
            ``j`` is global block ``j * world + rank``; any strides. Columns
            whose block is not valid for a row are never read.
        seq_lens: integer ``[requests]`` (``requests >= tokens // query_len``),
            each request's context length including its query tokens.
        topk: keys kept per ``(head, row)``, ``1 <= topk <= 2048``.
        rank, world: this rank and the CP group size.
        query_len: query tokens per request; ``tokens % query_len == 0``.
        global_blocks: global block slots, ``0 <= global_blocks < 65535`` and
            ``local >= ceil(global_blocks / world)``.
        init_blocks, local_blocks: pinned sink and recent blocks, ``>= 0``.
        out: int64 ``[heads, tokens, >= topk]``; ``out[h, row, :topk]`` receives
            the keys in descending order, padded with 0.
        stream: launch stream (default: CuPy's current stream, else the
            default stream).
        method: ``"warp"`` (warps sort in registers; ``topk`` up to 16 keys
            per lane of a warp, 512 on NVIDIA), ``"radix"`` (block radix
            select, any ``topk``) or ``"auto"`` (warp where it fits).
        threads, sort_limit: launch tuning. ``"warp"``: threads per row, a
            power-of-two number of whole warps, and the keys one warp sorts per
            pass. ``"radix"``: threads per block, and the most keys a row sorts
            (rows with more are radix-selected down to that many first).
            Results depend on none of these.

    Returns:
        ``out``.
    """
    arrays = (scores, seq_lens, out)
    scalars = (topk, rank, world, query_len, global_blocks, init_blocks, local_blocks, method,
               threads, sort_limit)
    launch, pointers = _SHARD_LAUNCHES.launch_for(arrays, scalars, _plan_local_topk)
    launch(arrays, stream, pointers)
    return out


def _plan_local_topk(arrays, topk, rank, world, query_len, global_blocks, init_blocks,
                     local_blocks, method, threads, sort_limit):
    topk = validate.integer("topk", topk, low=1, high=MAX_TOPK + 1)
    world = validate.integer("world", world, low=1)
    rank = validate.integer("rank", rank, low=0, high=world)
    query_len = validate.integer("query_len", query_len, low=1)
    global_blocks = validate.integer("global_blocks", global_blocks, low=0,
                                     high=MAX_GLOBAL_BLOCKS)
    init_blocks = validate.integer("init_blocks", init_blocks, low=0)
    local_blocks = validate.integer("local_blocks", local_blocks, low=0)

    scores_a, seq_lens_a, out_a = (as_kernel_array(a, name) for a, name in
                                   zip(arrays, ("scores", "seq_lens", "out")))
    validate.dtype(scores_a, "float32")
    validate.ndim(scores_a, 3)
    validate.dtype(out_a, "int64")
    validate.ndim(out_a, 3)
    heads, tokens, local = scores_a.shape
    validate.dim(out_a, 0, heads, "heads, as in scores")
    validate.dim(out_a, 1, tokens, "tokens, as in scores")
    validate.dim_at_least(out_a, 2, topk, "topk")
    validate.rows(tokens, query_len, seq_lens_a)
    validate.dim_at_least(scores_a, 2, -(-global_blocks // world),
                          "local columns: ceil(global_blocks / world)")

    candidates = -(-global_blocks // world)
    if _method(method, topk) == "warp":
        run, slots, warps = _warp_shape(topk, candidates, threads, sort_limit)
        kernel, threads = shard_topk_warp_kernel(run, slots, warps), warps * WARP_LANES
    else:
        threads, capacity = _launch_shape(topk, candidates, threads, sort_limit)
        kernel = shard_topk_kernel(capacity)
    if not (heads and tokens):
        return _NoWork()
    return KernelLaunch(
        kernel, (tokens, heads), threads,
        arrays=[("scores", False), ("seq_lens", False), ("out", False)],
        scalars=[topk, rank, world, query_len, global_blocks, init_blocks, local_blocks],
        order=[("a", 0), ("a", 1), ("a", 2)] + [("s", j) for j in range(7)])


def _table_arrays(heads, tokens, topk, requests, attention_block_table,
                  sparse_block_table_out, sparse_context_lens_out, block_page_stride):
    given = [a is not None for a in (attention_block_table, sparse_block_table_out,
                                     sparse_context_lens_out)]
    if not any(given):
        if block_page_stride is not None:
            raise ValueError("block_page_stride is only used with attention_block_table")
        return None
    if not all(given):
        missing = [name for name, g in zip(("attention_block_table", "sparse_block_table_out",
                                            "sparse_context_lens_out"), given) if not g]
        raise ValueError("attention_block_table, sparse_block_table_out and "
                         "sparse_context_lens_out go together; missing: " + ", ".join(missing))
    page_stride = PAGES if block_page_stride is None else (
        validate.integer("block_page_stride", block_page_stride, low=0) or PAGES)
    table = as_kernel_array(attention_block_table, "attention_block_table")
    sbt = as_kernel_array(sparse_block_table_out, "sparse_block_table_out")
    ctx = as_kernel_array(sparse_context_lens_out, "sparse_context_lens_out")
    for array in (table, sbt, ctx):
        validate.dtype(array, "int32")
    validate.ndim(table, 2)
    validate.dim_at_least(table, 0, requests, "one row per request")
    validate.ndim(sbt, 2, 3)
    validate.ndim(ctx, 1, 2)
    if ctx.ndim != sbt.ndim - 1:
        raise ValueError(f"sparse_context_lens_out must be {sbt.ndim - 1}-D to match the "
                         f"{sbt.ndim}-D sparse_block_table_out, got shape {ctx.shape}")
    two_d = sbt.ndim == 2
    if two_d:
        if heads != 1:
            raise ValueError(f"sparse_block_table_out: the 2-D layout [tokens, topk * {PAGES}] "
                             f"holds one head, but there are {heads}; pass the per-head layout "
                             f"[heads, tokens, topk * {PAGES}]")
        sbt = with_leading_axis(sbt)
    validate.dim(sbt, 0, heads, "heads")
    validate.dim(sbt, 1, tokens, "tokens")
    validate.dim_at_least(sbt, 2, topk * PAGES, f"topk * {PAGES} pages")
    if ctx.ndim == 1:
        ctx = with_leading_axis(ctx)
    validate.dim(ctx, 0, heads, "heads")
    validate.dim(ctx, 1, tokens, "tokens")
    return page_stride, two_d


def merge_topk_keys(keys, topk_idx, seq_lens, *, query_len, init_blocks, local_blocks,
                    attention_block_table=None, sparse_block_table_out=None,
                    sparse_context_lens_out=None, block_page_stride=None, stream=None,
                    method="auto", threads=None, sort_limit=None):
    """Merge gathered shard keys into global per-head top-k block ids (SPEC.md).

    Args:
        keys: int64 ``[world, heads, tokens, per_shard]``, every rank's
            :func:`local_topk_keys` output; any strides.
        topk_idx: int32 ``[heads, tokens, topk]`` output, ``topk <= 2048``:
            block ids in descending key order, ``-1`` past
            ``min(topk, valid_blocks)`` and for absent keys.
        seq_lens, query_len, init_blocks, local_blocks: as for
            :func:`local_topk_keys`; keys are pinned again with each row's window.
        attention_block_table: optional int32 ``[requests, max_blocks]``, the
            logical page of each block. With it, the paged sparse block table
            is written too (blocks at or past ``max_blocks`` count as not
            selected):
        sparse_block_table_out: int32 ``[heads, tokens, >= topk * 8]``, or
            ``[tokens, >= topk * 8]`` when ``heads == 1``.
        sparse_context_lens_out: int32 ``[heads, tokens]`` (or ``[tokens]``).
        block_page_stride: page index stride per block (default 8).
        stream, method, threads, sort_limit: as for :func:`local_topk_keys`.

    Returns:
        ``topk_idx``.
    """
    arrays = (keys, topk_idx, seq_lens, attention_block_table, sparse_block_table_out,
              sparse_context_lens_out)
    scalars = (query_len, init_blocks, local_blocks, block_page_stride, method, threads,
               sort_limit)
    launch, pointers = _MERGE_LAUNCHES.launch_for(arrays, scalars, _plan_merge)
    launch(arrays, stream, pointers)
    return topk_idx


def _plan_merge(arrays, query_len, init_blocks, local_blocks, block_page_stride, method,
                threads, sort_limit):
    keys, topk_idx, seq_lens, attention_block_table, sparse_block_table_out, \
        sparse_context_lens_out = arrays
    query_len = validate.integer("query_len", query_len, low=1)
    init_blocks = validate.integer("init_blocks", init_blocks, low=0)
    local_blocks = validate.integer("local_blocks", local_blocks, low=0)
    keys_a = as_kernel_array(keys, "keys")
    idx_a = as_kernel_array(topk_idx, "topk_idx")
    seq_lens_a = as_kernel_array(seq_lens, "seq_lens")
    validate.dtype(keys_a, "int64")
    validate.ndim(keys_a, 4)
    validate.dtype(idx_a, "int32")
    validate.ndim(idx_a, 3)
    world, heads, tokens, per_shard = keys_a.shape
    validate.dim_at_least(keys_a, 0, 1, "world")
    validate.dim(idx_a, 0, heads, "heads, as in keys")
    validate.dim(idx_a, 1, tokens, "tokens, as in keys")
    topk = idx_a.shape[2]
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx.shape[2] (topk) must be in [1, {MAX_TOPK}], got {topk}")
    requests = validate.rows(tokens, query_len, seq_lens_a)
    tables = _table_arrays(heads, tokens, topk, requests, attention_block_table,
                           sparse_block_table_out, sparse_context_lens_out, block_page_stride)

    if _method(method, topk) == "warp":
        shape = _warp_shape(topk, world * per_shard, threads, sort_limit)
        threads = shape[2] * WARP_LANES
        ids_kernel, table_kernel = merge_topk_warp_kernel, merge_sparse_table_warp_kernel
    else:
        threads, capacity = _launch_shape(topk, world * per_shard, threads, sort_limit,
                                          merge=True)
        shape = (capacity,)
        ids_kernel, table_kernel = merge_topk_kernel, merge_sparse_table_kernel
    if not (heads and tokens):
        return _NoWork()
    order = [("a", 0), ("a", 2), ("a", 1), ("s", 0), ("s", 1), ("s", 2)]
    names = [("keys", False), ("topk_idx", False), ("seq_lens", False)]
    scalars = [query_len, init_blocks, local_blocks]
    if tables is None:
        return KernelLaunch(ids_kernel(*shape), (tokens, heads), threads,
                            arrays=names, scalars=scalars, order=order)
    page_stride, two_d = tables
    names += [("attention_block_table", False), ("sparse_block_table_out", two_d),
              ("sparse_context_lens_out", two_d)]
    return KernelLaunch(table_kernel(*shape), (tokens, heads), threads,
                        arrays=names, scalars=scalars + [page_stride],
                        order=order + [("a", 3), ("s", 3), ("a", 4), ("a", 5)])
