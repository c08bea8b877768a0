"""What every kernel family shares: the row window, the candidate readers, the
sparse-table writer, and the parameters of the three kernels each family builds.

Launch shape of every family: ``grid = (tokens, heads)``, one block per
``(head, row)``. A family (:mod:`.warp`, :mod:`.radix`) differs only in how a
block selects the row's top keys; where the candidates come from and where the
results go is here.
"""

from functools import lru_cache

from numba import float32, int64, uint64

from ..backend import cuda
from ..constants import PAGES, SPARSE_BLOCK
from .ipc import PEER_SLOTS
from .keys import causal_len_of, quotient, repin_key, score_key, valid_blocks_of
from .params import INTEGER, Array, by_address, scalars
from .primitives import float_bits, inline_device, lane_counts

__all__ = ["PACK_PARAMS", "MERGE_PARAMS", "MERGE_TABLE_PARAMS", "MERGE_KEYS_PARAMS",
           "SELECT_PARAMS", "SELECT_TABLE_PARAMS", "PACK_TO_PEERS_PARAMS", "whole_row",
           "MERGE_DELIVERED_PARAMS", "MERGE_DELIVERED_TABLE_PARAMS", "MERGE_DELIVERED_KEYS_PARAMS",
           "shard_candidate_key", "gathered_candidate_key", "shard_row", "gathered_row",
           "shard_load", "shard_key_of", "gathered_load", "gathered_key_of",
           "shard_place", "gathered_place", "request_seq_len", "row_request",
           "merged_block", "table_writer", "page_of"]

# The kernels' parameters: the wrappers' arrays in the wrappers' order, then scalars.
PACK_PARAMS = (Array("scores", "float32", 3), Array("seq_lens", INTEGER, 1),
               Array("out", "int64", 3),
               *scalars("topk", "rank", "world", "query_len", "global_blocks", "init_blocks",
                        "local_blocks"))
MERGE_PARAMS = (Array("keys", "int64", 4), Array("topk_idx", "int32", 3),
                Array("seq_lens", INTEGER, 1),
                *scalars("query_len", "init_blocks", "local_blocks"))
# The two-level exchange's first merge keeps keys: the same inputs, a pack's output.
MERGE_KEYS_PARAMS = (MERGE_PARAMS[0], Array("out", "int64", 3), MERGE_PARAMS[2],
                     *scalars("topk", "query_len", "init_blocks", "local_blocks"))
# World 1 in one kernel: the scores' top-k straight to block ids (and the table).
SELECT_PARAMS = (PACK_PARAMS[0], PACK_PARAMS[1], MERGE_PARAMS[1],
                 *scalars("query_len", "global_blocks", "init_blocks", "local_blocks"))
# The 2-D one-head table layout is launched as [1, ...]: the kernels see 3-D and 2-D.
MERGE_TABLE_PARAMS = (*MERGE_PARAMS[:3], Array("block_table", "int32", 2),
                      Array("sparse_table", "int32", 3), Array("context_lens", "int32", 2),
                      *MERGE_PARAMS[3:], *scalars("page_stride"))
SELECT_TABLE_PARAMS = (*SELECT_PARAMS[:3], *MERGE_TABLE_PARAMS[3:6], *SELECT_PARAMS[3:],
                       *scalars("page_stride"))
# The pack and the merge + table over C-contiguous arrays (int32 seq_lens), each by
# its address and shape: 17 parameter words instead of 36, 25 instead of 64.
PACK_ADDRESSED_PARAMS = by_address(PACK_PARAMS)
MERGE_TABLE_ADDRESSED_PARAMS = by_address(MERGE_TABLE_PARAMS)


# The delivered exchange (kernels/ipc.py): the pack writes its keys into every
# peer's exchange buffer (peer<q>: peer q's whole buffer as int64 words) and
# the merge reads them there, as keys[2 * npeers, heads, tokens, per_shard]
# over both halves, after waiting on its flags. The shard is addressed by
# ``rank`` and ``world`` (its blocks), the delivery by ``peer_rank`` and
# ``npeers`` (its slot, flag and peers): the same in the flat exchange, the
# rank's place in its node in the two-level one.
_WORDS = Array("ctrl", "int64", 1, "C")
PACK_TO_PEERS_PARAMS = (*PACK_PARAMS[:2], _WORDS,
                        *(_WORDS._replace(name=f"peer{q}") for q in range(PEER_SLOTS)),
                        *PACK_PARAMS[3:], *scalars("data_start", "slot", "peer_rank", "npeers"))
_WAIT_ARRAYS = (_WORDS, _WORDS._replace(name="flags"), _WORDS._replace(name="errors"))
MERGE_DELIVERED_PARAMS = (*MERGE_PARAMS[:3], *_WAIT_ARRAYS, *MERGE_PARAMS[3:],
                          *scalars("timeout_ns", "block_wait"))
MERGE_DELIVERED_TABLE_PARAMS = (*MERGE_PARAMS[:3], *_WAIT_ARRAYS, *MERGE_TABLE_PARAMS[3:],
                                *scalars("timeout_ns", "block_wait"))
# The two-level exchange's node level, fused: the delivered keys -> the node's keys.
MERGE_DELIVERED_KEYS_PARAMS = (*MERGE_KEYS_PARAMS[:3], *_WAIT_ARRAYS, *MERGE_KEYS_PARAMS[3:],
                               *scalars("timeout_ns", "block_wait"))

# ctx tuples handed to the candidate readers
# shard:    (head, row, rank, world, init_blocks, local_start)
# gathered: (head, row, per_shard, log2(per_shard) or -1, init_blocks, local_start, first)
#           rank q's keys are keys[first + q]
#
# A candidate is read in two steps: ``*_load(src, ctx, i)`` fetches its raw
# value and uses only the fields that say where the row is, which need no
# seq_lens; ``*_key_of(raw, ctx, i)`` pins it with the row's window. A kernel
# can so issue its first loads with a "place" ctx (``shard_place``,
# ``gathered_place``: the window fields zero) while seq_lens is still in flight.
#
# Load order. The kernels that read scores take the row's request first
# (``row_request``), then issue the score loads, then the seq_lens load
# (``request_seq_len``), so that the two loads travel together and the quotient
# no longer sits between them. The merges issue their key loads before anything
# else: a table merge's page lookups wait on them. On one H100 (BENCHMARKS.md,
# "Small rows, 2026-12-06: load order") the first order took 0.05 us off b's pack
# and 0.2-0.3 us off the warp kernels' world-1 kernels, and cost the merges
# 0.04-0.18 us where they used it.


@cuda.jit(device=True, inline=True)
def shard_load(scores, ctx, column):
    return scores[uint64(ctx[0]), uint64(ctx[1]), uint64(column)]


@cuda.jit(device=True, inline=True)
def shard_key_of(score, ctx, column):
    head, row, rank, world, init_blocks, local_start = ctx
    return score_key(score, column * world + rank, init_blocks, local_start)


@cuda.jit(device=True, inline=True)
def shard_candidate_key(scores, ctx, column):
    return shard_key_of(shard_load(scores, ctx, column), ctx, column)


@cuda.jit(device=True, inline=True)
def gathered_load(keys, ctx, i):
    head, row, per_shard, shift, init_blocks, local_start, first = ctx
    if shift >= 0:  # per_shard is a power of two (it usually is topk): no division
        rank = i >> shift
        column = i & (per_shard - 1)
    else:
        rank = i // per_shard
        column = i - rank * per_shard
    return keys[uint64(first + rank), uint64(head), uint64(row), uint64(column)]


@cuda.jit(device=True, inline=True)
def gathered_key_of(key, ctx, i):
    if key == 0:
        return int64(0)
    return repin_key(key, ctx[4], ctx[5])


@cuda.jit(device=True, inline=True)
def gathered_candidate_key(keys, ctx, i):
    return gathered_key_of(gathered_load(keys, ctx, i), ctx, i)


@cuda.jit(device=True, inline=True)
def shard_place(rank, world):
    """A shard ctx without the window: enough for ``shard_load``."""
    return (int64(cuda.blockIdx.y), int64(cuda.blockIdx.x), int64(rank), int64(world),
            int64(0), int64(0))


@cuda.jit(device=True, inline=True)
def gathered_place(keys, first):
    """A gathered ctx without the window: enough for ``gathered_load``."""
    per_shard = int64(keys.shape[3])
    return (int64(cuda.blockIdx.y), int64(cuda.blockIdx.x), per_shard,
            per_shard_shift(per_shard), int64(0), int64(0), int64(first))


@cuda.jit(device=True, inline=True)
def shard_candidate_count(valid_blocks, global_blocks, rank, world, local):
    """Local columns ``j`` whose block ``j * world + rank`` is valid for the row."""
    limit = min(valid_blocks, global_blocks)
    if limit <= rank:
        return int64(0)
    return min(quotient(limit - rank + world - 1, world), local)


@cuda.jit(device=True, inline=True)
def row_request(query_len):
    """The request of this block's row (the index of its ``seq_lens`` entry)."""
    return quotient(int64(cuda.blockIdx.x), query_len)


@cuda.jit(device=True, inline=True)
def request_seq_len(seq_lens, request):
    """``(request, seq_lens[request])``: what :func:`row_window` takes. Split from
    :func:`row_request` so that a kernel can place this load after its first ones."""
    return request, seq_lens[uint64(request)]


@cuda.jit(device=True, inline=True)
def row_window(request_len, row, query_len, local_blocks):
    request, seq_len = request_len
    causal_len = causal_len_of(seq_len, row - request * query_len, query_len)
    valid_blocks = valid_blocks_of(causal_len)
    return request, causal_len, valid_blocks, max(valid_blocks - local_blocks, 0)


@cuda.jit(device=True, inline=True)
def per_shard_shift(per_shard):
    """log2(per_shard) when it is a power of two, else -1 (see gathered_candidate_key);
    read from the exponent of ``float32(per_shard)``, as keys.quotient does."""
    # Selects, not branches: the merges compute this before their first load.
    shift = (float_bits(float32(per_shard)) >> 23) - 127
    pow2 = (per_shard > 0) & ((per_shard & (per_shard - 1)) == 0)
    return shift if pow2 else int64(-1)


@cuda.jit(device=True, inline=True)
def shard_row(scores, request_len, rank, world, query_len, global_blocks, init_blocks,
              local_blocks):
    """This block's ``(head, row)``, its shard candidate count and candidate ctx;
    ``request_len`` is :func:`request_seq_len`'s."""
    row = int64(cuda.blockIdx.x)
    head = int64(cuda.blockIdx.y)
    _, _, valid_blocks, local_start = row_window(request_len, row, query_len, local_blocks)
    count = shard_candidate_count(valid_blocks, global_blocks, rank, world, scores.shape[2])
    return head, row, count, (head, row, rank, world, init_blocks, local_start)


@cuda.jit(device=True, inline=True)
def whole_row(scores, request_len, query_len, global_blocks, init_blocks, local_blocks):
    """World 1: this block's ``(head, row, request, causal_len, valid_blocks, candidates,
    ctx)``, the shard being the whole row."""
    row = int64(cuda.blockIdx.x)
    head = int64(cuda.blockIdx.y)
    request, causal_len, valid_blocks, local_start = row_window(request_len, row, query_len,
                                                                local_blocks)
    count = shard_candidate_count(valid_blocks, global_blocks, 0, 1, scores.shape[2])
    ctx = (head, row, int64(0), int64(1), init_blocks, local_start)
    return head, row, request, causal_len, valid_blocks, count, ctx


@cuda.jit(device=True, inline=True)
def gathered_row(keys, first, world, request_len, query_len, init_blocks, local_blocks):
    """This block's ``(head, row, request, causal_len, valid_blocks, candidates, ctx)``;
    the gathered keys are ``keys[first:first + world]``."""
    row = int64(cuda.blockIdx.x)
    head = int64(cuda.blockIdx.y)
    request, causal_len, valid_blocks, local_start = row_window(request_len, row, query_len,
                                                                local_blocks)
    per_shard = int64(keys.shape[3])
    ctx = (head, row, per_shard, per_shard_shift(per_shard), init_blocks, local_start, first)
    return head, row, request, causal_len, valid_blocks, world * per_shard, ctx


@cuda.jit(device=True, inline=True)
def merged_block(key, position, kept):
    """Block id of the merged key at ``position``, or -1 past ``kept`` or for key 0."""
    return (key & 0xFFFF) - 1 if (position < kept and key != 0) else int64(-1)


@cuda.jit(device=True, inline=True)
def page_of(block, request, block_table, page_stride):
    """Block ``block``'s first page in request ``request``, or 0 where the block
    table has no such column (the table writer uses only blocks it has)."""
    if 0 <= block < block_table.shape[1]:
        return int64(block_table[uint64(request), uint64(block)]) * page_stride
    return int64(0)


@lru_cache(maxsize=None)
def table_writer(slots, preloaded=False):
    """``write(blocks, pages, topk, causal_len, request, head, row, block_table,
    page_stride, sparse_table, context_lens, lane)``: SPEC.md's paged sparse
    block table of one ``(head, row)``, written by the lanes of one whole warp.

    ``blocks`` is the lane's local array of ``slots`` merged block ids (or -1)
    at positions ``e = lane * slots + s``; it is overwritten. ``pages``, a
    local int64 array of ``slots``, gets each used block's first page; with
    ``preloaded`` it holds them already (``block_table[request, b] *
    page_stride``, read while the row was still being selected), and used
    entries are not looked up again. A used full block's output slot is the
    number of full blocks before it: an exclusive scan over the lanes
    (:func:`~.primitives.lane_counts`); the tail block takes the slot after the
    last full one.
    """

    store_slots = _slots_pages(slots)
    count_lanes = lane_counts(slots.bit_length())

    @inline_device
    def write_sparse_table(blocks, pages, topk, causal_len, request, head, row, block_table,
                           page_stride, sparse_table, context_lens, lane):
        ctx_len = max(causal_len, 0)
        self_blk = (causal_len - 1) // SPARSE_BLOCK
        columns = block_table.shape[1]
        # The page lookups go first, all in flight at once, and the scan runs
        # while they travel: they need only the block ids.
        full = int64(0)
        tail = False
        for s in range(slots):
            e = lane * slots + s
            b = blocks[s]
            if e < topk and ctx_len > 0 and 0 <= b <= self_blk and b < columns:
                if not preloaded:
                    pages[s] = block_table[request, b] * page_stride
                if b < self_blk:
                    full += 1
                else:
                    tail = True
        before, n_full, tailed = count_lanes(full, tail, lane)
        before = int64(before)  # full blocks in lower lanes
        n_full = int64(n_full)
        tails = int64(1) if tailed else int64(0)
        n_used = n_full + tails
        if lane == 0:
            if tails:
                context_lens[uint64(head), uint64(row)] = (
                    n_full * SPARSE_BLOCK + (ctx_len - self_blk * SPARSE_BLOCK))
            else:
                context_lens[uint64(head), uint64(row)] = min(n_used * SPARSE_BLOCK, ctx_len)
        for s in range(slots):
            e = lane * slots + s
            b = blocks[s]
            slot = int64(-1)
            if e < topk and ctx_len > 0 and 0 <= b <= self_blk and b < columns:
                if b < self_blk:
                    slot = before
                    before += 1
                else:
                    slot = n_full
            blocks[s] = slot
        store_slots(blocks, pages, sparse_table, head, row, n_used, topk, lane)

    return write_sparse_table


@lru_cache(maxsize=None)
def _slot_pages(s, slots):
    """Slot ``s``'s eight page ids (or zeros past the used entries), with ``s`` a
    constant: the caller's slots are one call each, so ``blocks`` and ``pages``
    keep constant indices even where the compiler would leave a loop over the
    slots rolled (it did on AMD GPUs, putting both arrays in scratch)."""

    @inline_device
    def store(blocks, pages, sparse_table, head, row, n_used, topk, lane):
        e = lane * slots + s
        slot = blocks[s]
        if slot >= 0:
            for p in range(PAGES):
                sparse_table[uint64(head), uint64(row), uint64(slot * PAGES + p)] = pages[s] + p
        if n_used <= e < topk:
            for p in range(PAGES):
                sparse_table[uint64(head), uint64(row), uint64(e * PAGES + p)] = 0

    return store


@lru_cache(maxsize=None)
def _slots_pages(slots):
    """Every slot's pages: :func:`_slot_pages` of each slot, called in order
    (generated as flat source, one call per slot)."""
    names = [f"slot_{s}" for s in range(slots)]
    body = "".join(f"    {name}(blocks, pages, sparse_table, head, row, n_used, topk, lane)\n"
                   for name in names)
    namespace = {name: _slot_pages(s, slots) for s, name in enumerate(names)}
    header = "def store_slots(blocks, pages, sparse_table, head, row, n_used, topk, lane):\n"
    exec(header + body, namespace)  # noqa: S102
    return inline_device(namespace["store_slots"])
