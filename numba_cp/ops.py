"""Public host wrappers: validate, pick a launch shape, launch. Nothing else.

Both functions are graph safe: with the output buffers given they allocate
nothing on the device, copy nothing to the host and decide only from shapes
and keyword arguments (SPEC.md, "Graph safety"). Validation runs once per
argument signature (dtypes, shapes, strides, scalars); see :mod:`.launcher`.
"""

from __future__ import annotations

import numpy as np

from . import validate
from .arrays import as_kernel_array, c_contiguous
from .backend import TARGET
from .constants import MAX_GLOBAL_BLOCKS, MAX_PAGE_STRIDE, MAX_PINNED, MAX_TOPK, PAGES
from .kernels import ipc as ipc_kernels
from .kernels import radix, rank, warp
from .launcher import KernelLaunch, LaunchCache

__all__ = ["local_topk_keys", "merge_topk_keys", "check_local_topk_keys",
           "check_merge_topk_keys", "METHODS", "choose_method", "merge_keys", "global_topk_ids",
           "local_topk_keys_to_peers", "merge_delivered_keys", "merge_delivered_to_keys"]

# "warp": warps sort in registers (numba_cp.kernels.warp), for topk up to
# lanes * MAX_LANE_SLOTS; "rank": a block counts each key's place (numba_cp.kernels.rank),
# for rows of up to RANK_MAX_ROW candidates; "radix": block-wide radix select +
# shared-memory sort (numba_cp.kernels.radix), for any topk; "auto": choose_method.
METHODS = ("auto", "warp", "rank", "radix")
MAX_LANE_SLOTS = 16  # keys per lane per pass: 3 register arrays of this many int64
# Keys per lane per pass of the warp kernels (more when a run needs them). In
# the H200 launch sweeps (BENCHMARKS.md, "Launch shapes") 2 was the best or
# within 0.05 us of it in every pack and merge case but g's merge, where 1 key
# per lane was 0.15 us faster (0.5 us before the lane exchanges took one
# compare each).
WARP_SLOTS = 2
# A radix merge row of up to this many candidates is sorted outright.
MERGE_SORT_ALL = 256
# The rank kernels: the longest row they take (one key per thread and slot), and
# the most threads a row gets.
RANK_MAX_ROW = 1024  # 3 shared int64 words per candidate: 24 KiB, inside CUDA's 48 KiB
RANK_THREADS = 2 * TARGET.lanes if TARGET.simulator else 256
# "auto" takes the rank kernels for launches of up to RANK_AUTO_ROWS rows of up to
# RANK_AUTO_ROW candidates (see choose_method). A row of up to RANK_ONE_CHUNK
# candidates is ranked in one chunk, a longer one in chunks of RANK_CHUNK. On one
# H100 (BENCHMARKS.md, "Small rows, 2026-12-07 night"; median of 7 graph timings,
# twice each way), chunks of 32 against 64 took b's pack (256 candidates) 2.08 us
# against 2.18 and a's world-1 kernel (256) 2.01 against 2.11, but a's pack, whose 64
# candidates make one chunk of 64, 1.41 against 1.38. Chunks of 128 and 256 were
# 2.2-5.5x slower on the H200 ("Small rows: the rank kernels").
RANK_AUTO_ROW = 256
RANK_AUTO_ROWS = 256
RANK_ONE_CHUNK = 64
RANK_CHUNK = 32
# addressed=True: the warp and rank families' pack and merge + table kernels take
# C-contiguous arrays (with int32 seq_lens) by address and shape, in parameter blocks
# of 17 words instead of Numba's 36 (pack) and 25 instead of 64 (merge + table).
# Compiled for sm_90 as "auto" launches them (tools/param_lines.py), b's pack reads 4
# of constant bank 0's 64-byte lines instead of 6 (864 instructions of code instead
# of 872), g's merge + table 5 instead of 10 (1208 instead of 1272). On one H100, every
# kernel on the same arrays (compare_trees.py, median of 7 graph timings), g's merge +
# table took 1.81 us by address against 2.12 (its warp kernel 2.28 against 2.38), a's
# pack 1.45 against 1.49, b's pack 2.22 against 2.23: never slower, so on by default
# (BENCHMARKS.md, "Arrays by address on one NVIDIA H100, 2026-12-07"). They have not
# run on an AMD GPU: NUMBA_CP_ADDRESSED=0 turns them off for a whole job.
ADDRESSED_DEFAULT = True
ADDRESSED_ENV = "NUMBA_CP_ADDRESSED"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def choose_method(method, topk, candidates=None, rows=None):
    """The kernel family for ``method``, ``topk`` and ``rows`` rows of
    ``candidates``: ``"warp"``, ``"rank"`` or ``"radix"`` (``None``: unknown).

    ``"auto"`` takes the rank kernels for launches of at most RANK_AUTO_ROWS
    rows of at most RANK_AUTO_ROW candidates, and elsewhere the warp kernels
    wherever ``topk`` fits (a sorted run of ``next_pow2(topk)`` keys in one
    warp's registers). The radix kernels serve larger ``topk``. Measured on
    the H200 (BENCHMARKS.md, "Launch shapes" and "Small rows: the rank
    kernels"): the warp kernels were 3-5.5x faster than the radix kernels in
    every case (topk 16 to 128); the rank kernels beat the warp kernels by
    0.02-0.46 us on launches of 64-256 rows of 64-256 candidates (cases a, b,
    g) and lost by 0.1-1.7 us on 1024 rows (c, f), where a row's many threads
    compete for the GPU's issue slots. Re-measured on 2026-12-04 with the
    cheaper compares (BENCHMARKS.md, "Small rows, 2026-12-04"): rank still
    led on a and b (packs 2.09 and 2.77 against 2.39 and 2.91 us, merges
    1.89-1.90 against 2.07-2.09) and g, warp on c, d and f.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    fits = _next_pow2(topk) <= TARGET.lanes * MAX_LANE_SLOTS
    if method == "warp" and not fits:
        raise ValueError(f"method='warp' handles topk <= {TARGET.lanes * MAX_LANE_SLOTS} on "
                         f"this target, got topk={topk}; use method='radix' or 'auto'")
    if method == "rank" and candidates is not None and candidates > RANK_MAX_ROW:
        raise ValueError(f"method='rank' handles rows of up to {RANK_MAX_ROW} candidates, got "
                         f"{candidates}; use method='warp', 'radix' or 'auto'")
    if method == "rank" and _next_pow2(topk) > RANK_MAX_ROW:
        raise ValueError(f"method='rank' handles topk <= {RANK_MAX_ROW}, got topk={topk}; use "
                         f"method='warp', 'radix' or 'auto'")
    if method != "auto":
        return method
    if (candidates is not None and rows is not None and candidates <= RANK_AUTO_ROW
            and rows <= RANK_AUTO_ROWS and _next_pow2(topk) <= RANK_AUTO_ROW):
        return "rank"
    return "warp" if fits else "radix"


def default_sort_limit(topk: int, candidates: int, merge: bool) -> int:
    """The radix kernels' sort tile: the most keys a row sorts.

    Rows with more candidates are radix-selected until the survivors fit. A
    tile above topk saves radix passes, a smaller one saves sort stages. On a
    GPU max(64, 2 * topk), and for merge rows of up to 256 candidates all of
    them; the simulator keeps its small fixed tile so that the tests take both
    paths.
    """
    if TARGET.simulator:
        return TARGET.sort_tile
    if merge and candidates <= MERGE_SORT_ALL:
        return MERGE_SORT_ALL
    return max(TARGET.sort_tile, 2 * topk)


def _warp_shape(topk: int, candidates: int, threads, sort_limit):
    """``(run, slots, warps)``: the sorted run, keys per lane per pass, warps per row."""
    lanes = TARGET.lanes
    run = _next_pow2(topk)
    least = max(1, run // lanes)  # a run must fit in one warp
    if sort_limit is None:
        slots = max(least, min(WARP_SLOTS, _next_pow2(-(-candidates // lanes))))
    else:
        sort_limit = validate.integer("sort_limit", sort_limit, low=1,
                                      high=lanes * MAX_LANE_SLOTS + 1)
        slots = max(least, _next_pow2(-(-sort_limit // lanes)))
    if threads is None:
        warps = min(TARGET.row_warps, _next_pow2(-(-candidates // (lanes * slots))))
    else:
        threads = validate.integer("threads", threads, low=1, high=1025)
        warps = threads // lanes
        if threads % lanes or warps & (warps - 1):
            raise ValueError(f"threads must be a power-of-two number of whole warps "
                             f"({lanes} lanes each) for method='warp', got {threads}")
    return run, slots, warps


def _rank_shape(topk: int, candidates: int, threads, sort_limit, presorted):
    """``(run, slots, threads, chunk)``: the sorted run, keys per thread, threads
    per row and the keys ranked together (a merge's sorted runs need no chunks)."""
    lanes = TARGET.lanes
    run = _next_pow2(topk)
    capacity = max(run, lanes, _next_pow2(candidates))
    if threads is None:
        threads = min(RANK_THREADS, capacity)
    else:
        threads = validate.integer("threads", threads, low=1, high=1025)
        if threads % lanes or threads & (threads - 1):
            raise ValueError(f"threads must be a power-of-two number of whole warps "
                             f"({lanes} lanes each) for method='rank', got {threads}")
        capacity = max(capacity, threads)
    slots = max(capacity // threads, -(-run // lanes))
    capacity = threads * slots
    if presorted:  # a merge's runs come sorted: it ranks in runs only if they were not
        chunk = run
    elif sort_limit is None:
        chunk = RANK_ONE_CHUNK if capacity <= RANK_ONE_CHUNK else RANK_CHUNK
    else:
        chunk = _next_pow2(validate.integer("sort_limit", sort_limit, low=1,
                                            high=MAX_TOPK + 1))
    return run, slots, threads, min(max(chunk, run), capacity)


def _radix_shape(topk: int, candidates: int, threads, sort_limit, merge=False):
    """``(threads, capacity)``: threads per row and the shared sort tile (a power of two)."""
    threads = TARGET.threads if threads is None else validate.integer(
        "threads", threads, low=1, high=1025)
    if sort_limit is None:
        sort_limit = default_sort_limit(topk, candidates, merge)
    else:
        sort_limit = validate.integer("sort_limit", sort_limit, low=1, high=MAX_TOPK + 1)
    capacity = _next_pow2(max(topk, min(candidates, sort_limit)))
    return threads, capacity


class _NoWork:
    """The launch for an empty grid (no heads or no tokens)."""

    direct = False

    def __call__(self, objects, stream=None, pointers=None):
        return None


_PACK_LAUNCHES = LaunchCache()
_MERGE_LAUNCHES = LaunchCache()


def local_topk_keys(scores, seq_lens, *, topk, rank, world, query_len, global_blocks,
                    init_blocks, local_blocks, out, stream=None, method="auto", threads=None,
                    sort_limit=None, addressed=None):
    """Per-head top-k packed keys of this rank's shard (SPEC.md ``local_topk_keys``).

    Args:
        scores: float32 ``[heads, tokens, local]``, this rank's shard: column
            ``j`` is global block ``j * world + rank``; any strides. Columns
            whose block is not valid for a row are never used.
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
        stream: launch stream. Default: PyTorch's current stream when the
            first array (``scores`` here) is a PyTorch tensor, where a PyTorch
            caller queues the work around the call; else CuPy's current
            stream, else the default stream.
        method: ``"warp"`` (warps sort in registers; ``topk`` up to 16 keys
            per lane of a warp, 512 on NVIDIA), ``"rank"`` (a block counts
            each key's place; rows of up to 1024 candidates), ``"radix"``
            (block radix select, any ``topk``) or ``"auto"`` (rank on small
            grids of short rows, else warp where it fits; see choose_method).
        threads, sort_limit: launch tuning. ``"warp"``: threads per row, a
            power-of-two number of whole warps, and the keys one warp sorts per
            pass. ``"rank"``: threads per row (whole warps, a power of two),
            and the keys ranked together in a chunk. ``"radix"``: threads per
            block, and the most keys a row sorts (rows with more are
            radix-selected down to that many first). Results depend on none of
            these.
        addressed: whether the warp and rank kernels take the arrays by address
            and shape, a smaller kernel parameter block (where every array is
            C-contiguous and ``seq_lens`` is int32; None: ``NUMBA_CP_ADDRESSED``
            where set, else on). It never changes the result either.

    Returns:
        ``out``.
    """
    launch, arrays, pointers = _pack_launch(scores, seq_lens, out, topk, rank, world, query_len,
                                            global_blocks, init_blocks, local_blocks, method,
                                            threads, sort_limit, addressed)
    launch(arrays, stream, pointers)
    return out


def check_local_topk_keys(scores, seq_lens, *, topk, rank, world, query_len, global_blocks,
                          init_blocks, local_blocks, out, method="auto", threads=None,
                          sort_limit=None, addressed=None):
    """Validate a :func:`local_topk_keys` call without launching it (raises as it would)."""
    _pack_launch(scores, seq_lens, out, topk, rank, world, query_len, global_blocks,
                 init_blocks, local_blocks, method, threads, sort_limit, addressed)


def _pack_launch(scores, seq_lens, out, *scalars):
    arrays = (scores, seq_lens, out)
    launch, pointers = _PACK_LAUNCHES.launch_for(arrays, scalars, _plan_local_topk)
    return launch, arrays, pointers


def _plan_local_topk(arrays, topk, rank, world, query_len, global_blocks, init_blocks,
                     local_blocks, method, threads, sort_limit, addressed):
    addressed = _addressed_setting(addressed)
    scores_a, seq_lens_a, out_a = (as_kernel_array(a, name) for a, name in
                                   zip(arrays, ("scores", "seq_lens", "out")))
    scalars = _pack_scalars(scores_a, seq_lens_a, topk, rank, world, query_len, global_blocks,
                            init_blocks, local_blocks)
    validate.dtype(out_a, "int64")
    validate.ndim(out_a, 3)
    validate.writable_output(out_a)
    heads, tokens, _ = scores_a.shape
    validate.dim(out_a, 0, heads, "heads, as in scores")
    validate.dim(out_a, 1, tokens, "tokens, as in scores")
    validate.dim_at_least(out_a, 2, scalars[0], "topk")
    family, shape, threads = _pack_family(scalars, method, threads, sort_limit,
                                           heads * tokens)
    if not (heads and tokens):
        return _NoWork()
    arrays_a = [scores_a, seq_lens_a, out_a]
    by_address = addressed and _addressed(family, seq_lens_a, arrays_a)
    kernel = (family.pack_addressed_kernel if by_address else family.pack_kernel)(*shape)
    return KernelLaunch(kernel, (tokens, heads), threads, scalars,
                        footprint=validate.Footprint(arrays_a, {"out"}))


def _window(query_len, init_blocks, local_blocks):
    """The row window's scalars, validated (every kernel takes them)."""
    return (validate.integer("query_len", query_len, low=1),
            validate.integer("init_blocks", init_blocks, low=0, high=MAX_PINNED + 1),
            validate.integer("local_blocks", local_blocks, low=0, high=MAX_PINNED + 1))


def _merge_shapes(keys_a, out_a, out_dtype, ranks):
    """Gathered keys ``[ranks, heads, tokens, per_shard]`` and a merge output
    ``[heads, tokens, ...]`` that agree; returns the keys' shape."""
    validate.dtype(keys_a, "int64")
    validate.ndim(keys_a, 4)
    validate.dtype(out_a, out_dtype)
    validate.ndim(out_a, 3)
    validate.writable_output(out_a)
    validate.dim_at_least(keys_a, 0, 1, ranks)
    validate.dim(out_a, 0, keys_a.shape[1], "heads, as in keys")
    validate.dim(out_a, 1, keys_a.shape[2], "tokens, as in keys")
    return keys_a.shape


def _pack_scalars(scores_a, seq_lens_a, topk, rank, world, query_len, global_blocks,
                  init_blocks, local_blocks):
    """Validate the pack's scalars and its inputs; returns the scalars, as the kernels take them."""
    topk = validate.integer("topk", topk, low=1, high=MAX_TOPK + 1)
    world = validate.integer("world", world, low=1)
    rank = validate.integer("rank", rank, low=0, high=world)
    global_blocks = validate.integer("global_blocks", global_blocks, low=0,
                                     high=MAX_GLOBAL_BLOCKS)
    query_len, init_blocks, local_blocks = _window(query_len, init_blocks, local_blocks)
    validate.dtype(scores_a, "float32")
    validate.ndim(scores_a, 3)
    validate.rows(scores_a.shape[1], query_len, seq_lens_a)
    validate.dim_at_least(scores_a, 2, -(-global_blocks // world),
                          "local columns: ceil(global_blocks / world)")
    return [topk, rank, world, query_len, global_blocks, init_blocks, local_blocks]


def _pack_family(scalars, method, threads, sort_limit, rows):
    """``(family module, kernel shape, threads per block)`` of a pack."""
    topk, _, world, _, global_blocks = scalars[:5]
    return _family(topk, -(-global_blocks // world), method, threads, sort_limit, merge=False,
                   rows=rows)


def _family(topk, candidates, method, threads, sort_limit, merge, rows):
    """``(family module, kernel shape, threads per block)`` for ``rows`` rows of
    ``candidates``."""
    chosen = choose_method(method, topk, candidates, rows)
    if chosen == "rank":
        shape = _rank_shape(topk, candidates, threads, sort_limit, presorted=merge)
        return rank, shape, shape[2]
    if chosen == "warp":
        shape = _warp_shape(topk, candidates, threads, sort_limit)
        return warp, shape, shape[2] * TARGET.lanes
    threads, capacity = _radix_shape(topk, candidates, threads, sort_limit, merge=merge)
    return radix, (capacity,), threads


def local_topk_keys_to_peers(scores, seq_lens, *, topk, rank, world, query_len, global_blocks,
                             init_blocks, local_blocks, ctrl, peers, data_start, slot,
                             peer_rank=None, stream=None, method="auto", threads=None,
                             sort_limit=None):
    """:func:`local_topk_keys`, delivering the keys into every peer's exchange buffer.

    The pack of the fused IPC exchange (protocol: :mod:`numba_cp.kernels.ipc`):
    ``peers[q]`` is peer ``q``'s whole exchange buffer as int64 words (flags
    from word 0, the two data halves of ``len(peers)`` slots of ``slot`` words
    from ``data_start``), ``ctrl`` this rank's control words. The keys land in
    the send layout ``[heads, tokens, topk]`` of slot ``peer_rank``, and the
    grid's last block raises flag ``peer_rank`` in every peer.

    ``rank`` and ``world`` say which blocks the shard holds; ``peer_rank``
    (default ``rank``, and then ``peers`` is every rank's buffer) is this
    rank's index among ``peers``: in a two-level exchange its place in its
    node, whose ranks are the peers.
    """
    # Unused peer parameters repeat a buffer; the kernel never touches them.
    arrays = (scores, seq_lens, ctrl, *peers, *peers[:1] * (ipc_kernels.PEER_SLOTS - len(peers)))
    launch, pointers = _PACK_LAUNCHES.launch_for(
        arrays, (topk, rank, world, query_len, global_blocks, init_blocks, local_blocks,
                 data_start, slot, peer_rank, len(peers), method, threads, sort_limit),
        _plan_pack_to_peers)
    launch(arrays, stream, pointers)


def _plan_pack_to_peers(arrays, topk, rank, world, query_len, global_blocks, init_blocks,
                        local_blocks, data_start, slot, peer_rank, npeers, method, threads,
                        sort_limit):
    scores_a, seq_lens_a = (as_kernel_array(a, name) for a, name in
                            zip(arrays, ("scores", "seq_lens")))
    scalars = _pack_scalars(scores_a, seq_lens_a, topk, rank, world, query_len, global_blocks,
                            init_blocks, local_blocks)
    if peer_rank is None:  # the flat exchange: the peers are every rank
        world = scalars[2]
        if not 1 <= world <= ipc_kernels.PEER_SLOTS:
            raise ValueError(f"world: delivering packs serve 1 to {ipc_kernels.PEER_SLOTS} "
                             f"ranks, got {world}")
        if npeers != world:
            raise ValueError(f"peers: one exchange buffer per rank ({world}), got {npeers}")
        peer_rank = scalars[1]
    else:
        if not 1 <= npeers <= ipc_kernels.PEER_SLOTS:
            raise ValueError(f"peers: delivering packs serve 1 to {ipc_kernels.PEER_SLOTS} "
                             f"peers, got {npeers}")
        peer_rank = validate.integer("peer_rank", peer_rank, low=0, high=npeers)
    heads, tokens, _ = scores_a.shape
    slot = validate.integer("slot", slot, low=heads * tokens * scalars[0])
    data_start = validate.integer("data_start", data_start, low=npeers + 1)
    ctrl_a = as_kernel_array(arrays[2], "ctrl")
    _words(ctrl_a, ipc_kernels.CTRL_WORDS)
    for q in range(npeers):
        _words(as_kernel_array(arrays[3 + q], f"peers[{q}]"), data_start + 2 * npeers * slot)
    family, shape, threads = _pack_family(scalars, method, threads, sort_limit,
                                           heads * tokens)
    if not (heads and tokens):
        return _NoWork()
    return KernelLaunch(family.pack_to_peers_kernel(*shape), (tokens, heads), threads,
                        scalars + [data_start, slot, peer_rank, npeers])


def _words(array, least):
    """A C-contiguous 1-D int64 array of at least ``least`` words (the exchange's)."""
    validate.dtype(array, "int64")
    validate.ndim(array, 1)
    if array.strides not in (None, (8,)):
        raise ValueError(f"{array.name}: must be contiguous, got strides {array.strides}")
    validate.dim_at_least(array, 0, least, "words")


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
        validate.integer("block_page_stride", block_page_stride, low=0,
                         high=MAX_PAGE_STRIDE + 1) or PAGES)
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
    if two_d and heads != 1:
        raise ValueError(f"sparse_block_table_out: the 2-D layout [tokens, topk * {PAGES}] "
                         f"holds one head, but there are {heads}; pass the per-head layout "
                         f"[heads, tokens, topk * {PAGES}]")
    leading = (1,) if two_d else ()  # the one-head layout is launched as [1, ...]
    sbt_shape, ctx_shape = leading + sbt.shape, leading + ctx.shape
    if sbt_shape[:2] != (heads, tokens) or sbt_shape[2] < topk * PAGES:
        raise ValueError(f"sparse_block_table_out.shape must be [heads={heads}, "
                         f"tokens={tokens}, >= topk * {PAGES} = {topk * PAGES}] (or without "
                         f"heads when there is one), got {sbt.shape}")
    if ctx_shape != (heads, tokens):
        raise ValueError(f"sparse_context_lens_out.shape must be [heads={heads}, "
                         f"tokens={tokens}] (or [tokens] when there is one head), "
                         f"got {ctx.shape}")
    validate.writable_output(sbt)
    validate.writable_output(ctx)
    return page_stride, [table, sbt, ctx]


def merge_topk_keys(keys, topk_idx, seq_lens, *, query_len, init_blocks, local_blocks,
                    attention_block_table=None, sparse_block_table_out=None,
                    sparse_context_lens_out=None, block_page_stride=None, stream=None,
                    method="auto", threads=None, sort_limit=None, addressed=None):
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
        stream, method, threads, sort_limit: as for :func:`local_topk_keys`;
            with no ``stream``, ``keys`` picks the default.
        addressed: with the table, whether the warp and rank kernels take the
            arrays by address and shape, a smaller kernel parameter block (where
            every array is C-contiguous and ``seq_lens`` is int32; None:
            ``NUMBA_CP_ADDRESSED`` where set, else on). Like ``threads``, it never
            changes the result.

    Returns:
        ``topk_idx``.
    """
    launch, arrays, pointers = _merge_launch(
        (keys, topk_idx, seq_lens, attention_block_table, sparse_block_table_out,
         sparse_context_lens_out),
        (query_len, init_blocks, local_blocks, block_page_stride, method, threads, sort_limit,
         addressed))
    launch(arrays, stream, pointers)
    return topk_idx


def check_merge_topk_keys(keys, topk_idx, seq_lens, *, query_len, init_blocks, local_blocks,
                          attention_block_table=None, sparse_block_table_out=None,
                          sparse_context_lens_out=None, block_page_stride=None,
                          method="auto", threads=None, sort_limit=None, addressed=None):
    """Validate a :func:`merge_topk_keys` call without launching it (raises as it would)."""
    _merge_launch(
        (keys, topk_idx, seq_lens, attention_block_table, sparse_block_table_out,
         sparse_context_lens_out),
        (query_len, init_blocks, local_blocks, block_page_stride, method, threads, sort_limit,
         addressed))


def _merge_launch(arrays, scalars):
    launch, pointers = _MERGE_LAUNCHES.launch_for(arrays, scalars, _plan_merge)
    return launch, arrays, pointers


def _plan_merge(arrays, query_len, init_blocks, local_blocks, block_page_stride, method,
                threads, sort_limit, addressed):
    addressed = _addressed_setting(addressed)
    keys_a = as_kernel_array(arrays[0], "keys")
    return _merge_launch_for(keys_a, keys_a.shape[0] if keys_a.ndim == 4 else 0, arrays[1:],
                             [], [], query_len, init_blocks, local_blocks, block_page_stride,
                             method, threads, sort_limit, addressed)


def global_topk_ids(scores, seq_lens, topk_idx, *, query_len, global_blocks, init_blocks,
                    local_blocks, attention_block_table=None, sparse_block_table_out=None,
                    sparse_context_lens_out=None, block_page_stride=None, stream=None,
                    method="auto", threads=None, sort_limit=None):
    """The exchange at world 1 in one kernel: the scores' global top-k block ids.

    What :func:`local_topk_keys` (``rank=0, world=1``) followed by
    :func:`merge_topk_keys` writes, bit for bit, with no keys written to memory
    in between. ``scores`` is the whole row ``[heads, tokens, >= global_blocks]``;
    ``topk_idx`` and the optional table arrays are as for :func:`merge_topk_keys`.

    Returns:
        ``topk_idx``.
    """
    arrays = (scores, seq_lens, topk_idx, attention_block_table, sparse_block_table_out,
              sparse_context_lens_out)
    launch, pointers = _PACK_LAUNCHES.launch_for(
        arrays, (query_len, global_blocks, init_blocks, local_blocks, block_page_stride,
                 method, threads, sort_limit), _plan_global_topk_ids)
    launch(arrays, stream, pointers)
    return topk_idx


def _plan_global_topk_ids(arrays, query_len, global_blocks, init_blocks, local_blocks,
                          block_page_stride, method, threads, sort_limit):
    scores_a, seq_lens_a, idx_a = (as_kernel_array(a, name) for a, name in
                                   zip(arrays, ("scores", "seq_lens", "topk_idx")))
    validate.dtype(idx_a, "int32")
    validate.ndim(idx_a, 3)
    validate.writable_output(idx_a)
    topk = idx_a.shape[2]
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx.shape[2] (topk) must be in [1, {MAX_TOPK}], got {topk}")
    scalars = _pack_scalars(scores_a, seq_lens_a, topk, 0, 1, query_len, global_blocks,
                            init_blocks, local_blocks)
    heads, tokens, _ = scores_a.shape
    validate.dim(idx_a, 0, heads, "heads, as in scores")
    validate.dim(idx_a, 1, tokens, "tokens, as in scores")
    requests = validate.rows(tokens, scalars[3], seq_lens_a)
    tables = _table_arrays(heads, tokens, topk, requests, *arrays[3:], block_page_stride)
    family, shape, threads = _pack_family(scalars, method, threads, sort_limit,
                                           heads * tokens)
    if tables is not None and family is radix:  # the table writer needs one whole warp
        threads = max(threads, radix.TABLE_THREADS)
    if not (heads and tokens):
        return _NoWork()
    inputs = [scores_a, seq_lens_a, idx_a]
    outputs = {"topk_idx", "sparse_block_table_out", "sparse_context_lens_out"}
    if tables is None:
        return KernelLaunch(family.select_kernel(*shape), (tokens, heads), threads,
                            scalars[3:], footprint=validate.Footprint(inputs + [None] * 3,
                                                                      outputs))
    page_stride, table_arrays = tables
    return KernelLaunch(family.select_table_kernel(*shape), (tokens, heads), threads,
                        scalars[3:] + [page_stride],
                        footprint=validate.Footprint(inputs + table_arrays, outputs))


def merge_keys(keys, seq_lens, *, topk, query_len, init_blocks, local_blocks, out,
               stream=None, method="auto", threads=None, sort_limit=None):
    """Merge gathered keys into keys again: the first merge of a two-level exchange.

    Args:
        keys: int64 ``[ranks, heads, tokens, per_shard]``, gathered shard keys
            (or node keys); any strides.
        out: int64 ``[heads, tokens, >= topk]``; ``out[h, row, :topk]`` receives
            the row's ``topk`` largest keys, pinned with the row's window, in
            descending order, padded with 0: what :func:`local_topk_keys` would
            have packed from all of those ranks' columns together.
        Others as :func:`merge_topk_keys` and :func:`local_topk_keys`.

    Returns:
        ``out``.
    """
    arrays = (keys, out, seq_lens)
    launch, pointers = _MERGE_LAUNCHES.launch_for(
        arrays, (topk, query_len, init_blocks, local_blocks, method, threads, sort_limit),
        _plan_merge_keys)
    launch(arrays, stream, pointers)
    return out


def _plan_merge_keys(arrays, topk, query_len, init_blocks, local_blocks, method, threads,
                     sort_limit):
    keys_a = as_kernel_array(arrays[0], "keys")
    return _merge_keys_launch_for(keys_a, keys_a.shape[0] if keys_a.ndim == 4 else 0,
                                  arrays[1:], [], [], topk, query_len, init_blocks,
                                  local_blocks, method, threads, sort_limit)


def _merge_keys_launch_for(keys_a, ranks, arrays, waits, wait_scalars, topk, query_len,
                           init_blocks, local_blocks, method, threads, sort_limit):
    """The merge-to-keys launch over ``ranks`` ranks' keys; with ``waits`` (ctrl, flags,
    errors) the delivered kernel, which takes them after ``seq_lens``."""
    topk = validate.integer("topk", topk, low=1, high=MAX_TOPK + 1)
    query_len, init_blocks, local_blocks = _window(query_len, init_blocks, local_blocks)
    out_a, seq_lens_a = (as_kernel_array(a, name) for a, name in zip(arrays, ("out", "seq_lens")))
    _, heads, tokens, per_shard = _merge_shapes(keys_a, out_a, "int64", "ranks")
    validate.dim_at_least(out_a, 2, topk, "topk")
    validate.rows(tokens, query_len, seq_lens_a)
    family, shape, threads = _family(topk, ranks * per_shard, method, threads, sort_limit,
                                     merge=True, rows=heads * tokens)
    if not (heads and tokens):
        return _NoWork()
    kernel = (family.merge_delivered_keys_kernel if waits else family.merge_keys_kernel)(*shape)
    return KernelLaunch(kernel, (tokens, heads), threads,
                        [topk, query_len, init_blocks, local_blocks] + wait_scalars,
                        footprint=validate.Footprint([keys_a, out_a, seq_lens_a] + waits,
                                                     {"out"}))


def merge_delivered_to_keys(keys, seq_lens, *, topk, ctrl, flags, errors, timeout_ns, query_len,
                            init_blocks, local_blocks, out, block_wait=True, stream=None,
                            method="auto", threads=None, sort_limit=None):
    """:func:`merge_keys` of the fused IPC exchange: wait, then merge in place to keys.

    The node level of a two-level exchange in two kernels: after
    :func:`local_topk_keys_to_peers` delivered every node rank's keys,
    ``keys`` (int64 ``[2 * ranks, heads, tokens, per_shard]``, both halves of
    this rank's exchange buffer) is waited on and read as
    :func:`merge_delivered_keys` does, and ``out`` receives what
    :func:`merge_keys` writes from the gathered keys. Arguments as those two.
    """
    arrays = (keys, out, seq_lens, ctrl, flags, errors)
    launch, pointers = _MERGE_LAUNCHES.launch_for(
        arrays, (topk, timeout_ns, block_wait, query_len, init_blocks, local_blocks, method,
                 threads, sort_limit), _plan_merge_delivered_to_keys)
    launch(arrays, stream, pointers)
    return out


def _plan_merge_delivered_to_keys(arrays, topk, timeout_ns, block_wait, query_len, init_blocks,
                                  local_blocks, method, threads, sort_limit):
    keys_a = as_kernel_array(arrays[0], "keys")
    world, waits, wait_scalars = _delivered_waits(keys_a, arrays[3:6], timeout_ns, block_wait)
    return _merge_keys_launch_for(keys_a, world, arrays[1:3], waits, wait_scalars, topk,
                                  query_len, init_blocks, local_blocks, method, threads,
                                  sort_limit)


def _delivered_waits(keys_a, wait_arrays, timeout_ns, block_wait):
    """``(ranks, [ctrl, flags, errors], [timeout_ns, block_wait])`` of a delivered merge,
    validated; ``keys_a`` is both halves of the exchange buffer's slots."""
    halves = keys_a.shape[0] if keys_a.ndim == 4 else 0
    if halves < 2 or halves % 2:
        raise ValueError(f"keys: [2 * world, heads, tokens, per_shard] (both halves of the "
                         f"exchange buffer), got shape {keys_a.shape}")
    world = halves // 2
    waits = [as_kernel_array(a, name) for a, name in zip(wait_arrays, ("ctrl", "flags", "errors"))]
    for array, least in zip(waits, (ipc_kernels.CTRL_WORDS, world + 1,
                                    ipc_kernels.ERROR_WORDS)):
        _words(array, least)
    timeout_ns = validate.integer("timeout_ns", timeout_ns, low=1)
    if not isinstance(block_wait, (bool, np.bool_)):
        raise TypeError(f"block_wait must be a bool, got {type(block_wait).__name__}")
    return world, waits, [timeout_ns, int(block_wait)]


def merge_delivered_keys(keys, topk_idx, seq_lens, *, ctrl, flags, errors, timeout_ns,
                         query_len, init_blocks, local_blocks, block_wait=True,
                         attention_block_table=None,
                         sparse_block_table_out=None, sparse_context_lens_out=None,
                         block_page_stride=None, stream=None, method="auto", threads=None,
                         sort_limit=None):
    """:func:`merge_topk_keys` of the fused IPC exchange: wait, then merge in place.

    ``keys`` is int64 ``[2 * world, heads, tokens, per_shard]``, both halves
    of this rank's exchange buffer's slots; each block of the merge waits (at
    most ``timeout_ns`` of wall clock) until ``flags`` say that every rank
    delivered this call, and reads the half of this call's epoch (``ctrl``).
    A wait that gives up is recorded in ``ctrl`` and ``errors`` (protocol:
    :mod:`numba_cp.kernels.ipc`). ``block_wait=False``: no block waits, since
    ``ipc_wait_kernel`` waited before it on the stream. Other arguments as
    :func:`merge_topk_keys`.
    """
    arrays = (keys, topk_idx, seq_lens, ctrl, flags, errors, attention_block_table,
              sparse_block_table_out, sparse_context_lens_out)
    launch, pointers = _MERGE_LAUNCHES.launch_for(
        arrays, (timeout_ns, block_wait, query_len, init_blocks, local_blocks, block_page_stride,
                 method, threads, sort_limit), _plan_merge_delivered)
    launch(arrays, stream, pointers)
    return topk_idx


def _plan_merge_delivered(arrays, timeout_ns, block_wait, query_len, init_blocks, local_blocks,
                          block_page_stride, method, threads, sort_limit):
    keys_a = as_kernel_array(arrays[0], "keys")
    world, waits, wait_scalars = _delivered_waits(keys_a, arrays[3:6], timeout_ns, block_wait)
    return _merge_launch_for(keys_a, world, arrays[1:3] + arrays[6:], waits, wait_scalars,
                             query_len, init_blocks, local_blocks, block_page_stride, method,
                             threads, sort_limit)


def _addressed_setting(addressed):
    """The ``addressed=`` keyword as a bool (None: ``NUMBA_CP_ADDRESSED`` where it is
    set, else ADDRESSED_DEFAULT). Read when a call is planned, not on every call."""
    if addressed is None:
        setting = validate.env_switch(ADDRESSED_ENV, "Numba's array parameters",
                                      "arrays by address where they can be")
        return ADDRESSED_DEFAULT if setting is None else setting
    if not isinstance(addressed, (bool, np.bool_)):
        raise TypeError(f"addressed must be True, False or None, got {addressed!r}")
    return bool(addressed)


def _addressed(family, seq_lens, arrays):
    """Whether ``family``'s kernel over arrays by address takes ``arrays`` (all of the
    call's, ``seq_lens`` among them)."""
    return (family is not radix and seq_lens.dtype == np.int32
            and all(c_contiguous(a) for a in arrays))


def _merge_launch_for(keys_a, world, arrays, waits, wait_scalars, query_len, init_blocks,
                      local_blocks, block_page_stride, method, threads, sort_limit,
                      addressed=False):
    """The merge launch over ``world`` ranks' keys; with ``waits`` (ctrl, flags,
    errors) the delivered kernels, which take them after ``seq_lens``; with
    ``addressed``, the table kernel over arrays by address where it can."""
    topk_idx, seq_lens, attention_block_table, sparse_block_table_out, \
        sparse_context_lens_out = arrays
    query_len, init_blocks, local_blocks = _window(query_len, init_blocks, local_blocks)
    idx_a = as_kernel_array(topk_idx, "topk_idx")
    seq_lens_a = as_kernel_array(seq_lens, "seq_lens")
    _, heads, tokens, per_shard = _merge_shapes(keys_a, idx_a, "int32", "world")
    topk = idx_a.shape[2]
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx.shape[2] (topk) must be in [1, {MAX_TOPK}], got {topk}")
    requests = validate.rows(tokens, query_len, seq_lens_a)
    tables = _table_arrays(heads, tokens, topk, requests, attention_block_table,
                           sparse_block_table_out, sparse_context_lens_out, block_page_stride)

    candidates = world * per_shard
    family, shape, threads = _family(topk, candidates, method, threads, sort_limit, merge=True,
                                     rows=heads * tokens)
    if tables is not None and family is radix:  # the table writer needs one whole warp
        threads = max(threads, radix.TABLE_THREADS)
    if not (heads and tokens):
        return _NoWork()
    scalars = [query_len, init_blocks, local_blocks]
    inputs = [keys_a, idx_a, seq_lens_a] + waits
    outputs = {"topk_idx", "sparse_block_table_out", "sparse_context_lens_out"}
    delivered = bool(waits)
    if tables is None:
        kernel = (family.merge_delivered_kernel if delivered else family.merge_kernel)(*shape)
        return KernelLaunch(kernel, (tokens, heads), threads, scalars + wait_scalars,
                            footprint=validate.Footprint(inputs + [None] * 3, outputs))
    page_stride, table_arrays = tables
    if delivered:
        kernel = family.merge_delivered_table_kernel(*shape)
    elif addressed and _addressed(family, seq_lens_a, inputs + table_arrays):
        kernel = family.merge_table_addressed_kernel(*shape)
    else:
        kernel = family.merge_table_kernel(*shape)
    return KernelLaunch(kernel, (tokens, heads), threads, scalars + [page_stride] + wait_scalars,
                        footprint=validate.Footprint(inputs + table_arrays, outputs))
