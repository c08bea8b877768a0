"""The radix family: exact block-wide top-k of int64 keys (``method="radix"``).

Radix select, then a bitonic sort in shared memory; the pack, merge and merge +
sparse table kernels at the end are built from it per shared capacity.

One thread block owns one ``(head, row)``. Candidates are never materialised:
a ``candidate_key(src, ctx, i)`` device function recomputes key ``i`` on each
pass, so the pack reads scores and the merge reads gathered keys through the
same selection code, and neither needs scratch memory beyond shared arrays of
compile-time size ``capacity`` (a power of two >= topk).

Why this algorithm: keys of distinct valid blocks are distinct, so the k-th
largest key is a unique threshold and "every key >= threshold" is exactly the
top-k, with no tie handling and a deterministic result. The threshold is found
MSB-first, 8 bits per pass, over the 48 bits below the valid bit (at most six
passes), so the cost is linear in the candidate count whatever ``topk`` is.
The select stops as soon as every key at or above the current digit bucket
fits in the sort tile: those survivors are sorted in shared memory and the
first ``topk`` kept, so a tile somewhat larger than ``topk`` saves passes.
When all candidates fit in ``capacity`` the select is skipped and they are
sorted directly.
"""

from functools import lru_cache

from numba import int32, int64

from ..backend import cuda
from ..constants import KEY_VALID_BIT
from .ipc import await_delivery, close_delivery, deliver_key, delivery_base, open_delivery
from .params import declare
from .primitives import WARP_LANES, chain_grids, shared_atomic_add
from .rows import (MERGE_DELIVERED_KEYS_PARAMS, MERGE_DELIVERED_PARAMS,
                   MERGE_DELIVERED_TABLE_PARAMS, MERGE_KEYS_PARAMS,
                   MERGE_PARAMS, MERGE_TABLE_PARAMS, PACK_PARAMS, PACK_TO_PEERS_PARAMS,
                   SELECT_PARAMS, SELECT_TABLE_PARAMS, gathered_candidate_key, gathered_row,
                   merged_block, request_seq_len, row_request, shard_candidate_key, shard_row,
                   table_writer, whole_row)

__all__ = ["make_block_topk", "pack_kernel", "merge_kernel", "merge_table_kernel",
           "merge_keys_kernel", "select_kernel", "select_table_kernel",
           "pack_to_peers_kernel", "merge_delivered_kernel", "merge_delivered_table_kernel",
           "merge_delivered_keys_kernel", "TABLE_THREADS"]

RADIX_BITS = 8
RADIX = 1 << RADIX_BITS
GROUP = 16  # buckets summed per group, so one thread scans 16 + 16, not 256
GROUPS = RADIX // GROUP
SCRATCH = RADIX + GROUPS  # int32 scratch: the histogram, then the group sums
TOP_SHIFT = 40  # the digit just below the valid bit (bit 48)

# state slots (shared int64[STATE_SLOTS])
PREFIX, WANTED, THRESHOLD, TIES = 0, 1, 2, 3
STATE_SLOTS = 4


@cuda.jit(device=True)
def bitonic_sort_descending(values, size):
    """Sort shared ``values[0:size]`` (``size`` a power of two) largest first."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    span = 2
    while span <= size:
        stride = span >> 1
        while stride > 0:
            low = stride - 1  # strides are powers of two: no (emulated 64-bit) division
            for pair in range(tid, size >> 1, nthreads):
                i = ((pair & ~low) << 1) | (pair & low)
                j = i | stride
                a = values[i]
                b = values[j]
                if (a < b) == ((i & span) == 0):
                    values[i] = b
                    values[j] = a
            cuda.syncthreads()
            stride >>= 1
        span <<= 1


@cuda.jit(device=True)
def sum_groups(hist):
    """``hist[RADIX + g]`` = the count of bucket group ``g``; all threads take part."""
    for group in range(cuda.threadIdx.x, GROUPS, cuda.blockDim.x):
        total = 0
        for digit in range(group * GROUP, (group + 1) * GROUP):
            total += hist[digit]
        hist[RADIX + group] = total


@cuda.jit(device=True)
def choose_digit(hist, state, shift, topk, capacity):
    """One thread's step of the radix select: narrow the prefix by one digit.

    Finds the bucket holding the ``state[WANTED]``-th largest key under the
    current prefix. If every key at or above that bucket (with those already
    taken above the prefix) fits in ``capacity``, sets ``state[THRESHOLD]`` to
    the bucket's lowest key: collecting and sorting everything at or above it
    gives the top-k. ``state[TIES]`` is set instead when equal keys straddle
    the threshold at the last digit (duplicate keys, which only malformed
    gathered input has): how many copies of it to keep.
    """
    prefix = state[PREFIX]
    wanted = state[WANTED]
    above = int64(0)
    group = GROUPS - 1
    while group > 0 and above + hist[RADIX + group] < wanted:
        above += hist[RADIX + group]
        group -= 1
    digit = group * GROUP + GROUP - 1
    while digit > group * GROUP and above + hist[digit] < wanted:
        above += hist[digit]
        digit -= 1
    reached = above + hist[digit]
    if topk - wanted + reached <= capacity:  # first pass with < topk keys lands here too
        state[THRESHOLD] = ((prefix << RADIX_BITS) | digit) << shift
    elif shift == 0:  # the last digit: these keys are all equal to the threshold
        state[THRESHOLD] = (prefix << RADIX_BITS) | digit
        state[TIES] = wanted - above
    else:
        state[PREFIX] = (prefix << RADIX_BITS) | digit
        state[WANTED] = wanted - above


def make_block_topk(candidate_key, capacity):
    """Build ``block_topk(src, ctx, count, topk, sel, hist, state)`` for one key source.

    After it returns (all threads of the block must call it), ``sel[0:capacity]``
    holds the ``min(topk, non-zero candidates)`` largest keys in descending
    order followed by zeros.
    """

    @cuda.jit(device=True)
    def radix_threshold(src, ctx, count, topk, hist, state):
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        if tid == 0:
            state[PREFIX] = KEY_VALID_BIT >> (TOP_SHIFT + RADIX_BITS)
            state[WANTED] = topk
            state[THRESHOLD] = 0
            state[TIES] = 0
        shift = TOP_SHIFT
        while shift >= 0:
            for digit in range(tid, RADIX, nthreads):
                hist[digit] = 0
            cuda.syncthreads()
            prefix = state[PREFIX]
            for i in range(tid, count, nthreads):
                key = candidate_key(src, ctx, i)
                if (key >> (shift + RADIX_BITS)) == prefix:
                    shared_atomic_add(hist, int32((key >> shift) & (RADIX - 1)), int32(1))
            cuda.syncthreads()
            sum_groups(hist)
            cuda.syncthreads()
            if tid == 0:
                choose_digit(hist, state, shift, topk, capacity)
            cuda.syncthreads()
            if state[THRESHOLD] != 0:
                break
            shift -= RADIX_BITS
        return state[THRESHOLD]

    @cuda.jit(device=True)
    def block_topk(src, ctx, count, topk, sel, hist, state):
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        if count <= capacity:
            for i in range(tid, capacity, nthreads):
                sel[i] = candidate_key(src, ctx, i) if i < count else int64(0)
            cuda.syncthreads()
        else:
            threshold = radix_threshold(src, ctx, count, topk, hist, state)
            ties = state[TIES]
            above = topk - ties  # keys strictly above the threshold, when ties > 0
            for i in range(tid, capacity, nthreads):
                sel[i] = 0
            if tid == 0:
                hist[0] = 0
                hist[1] = 0
            cuda.syncthreads()
            for i in range(tid, count, nthreads):
                key = candidate_key(src, ctx, i)
                if key > threshold or (key == threshold and ties == 0):
                    sel[shared_atomic_add(hist, 0, int32(1))] = key
                elif key == threshold:
                    copy = shared_atomic_add(hist, 1, int32(1))
                    if copy < ties:
                        sel[above + copy] = key
            cuda.syncthreads()
        bitonic_sort_descending(sel, capacity)

    return block_topk


# ---------------------------------------------------------------------------
# Kernels: any number of threads per (head, row); the row's top keys end in
# shared memory (``sel``).

# The merge + table kernel hands the merged ids to the warp-wide table writer,
# so its blocks have at least one whole warp.
TABLE_THREADS = WARP_LANES


@lru_cache(maxsize=None)
def pack_kernel(capacity):
    block_topk = make_block_topk(shard_candidate_key, capacity)

    @cuda.jit
    @declare(*PACK_PARAMS, chained=True)
    def shard_topk_keys(scores, seq_lens, out, topk, rank, world, query_len,
                        global_blocks, init_blocks, local_blocks):
        chain_grids()
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, count, ctx = shard_row(scores, request_len, rank, world, query_len,
                                          global_blocks, init_blocks, local_blocks)
        block_topk(scores, ctx, count, topk, sel, hist, state)
        for j in range(cuda.threadIdx.x, topk, cuda.blockDim.x):
            out[head, row, j] = sel[j]

    return shard_topk_keys


@lru_cache(maxsize=None)
def pack_to_peers_kernel(capacity):
    """The fused IPC exchange's pack (protocol: kernels/ipc.py)."""
    block_topk = make_block_topk(shard_candidate_key, capacity)

    @cuda.jit
    @declare(*PACK_TO_PEERS_PARAMS, chained=True)
    def shard_topk_keys_to_peers(scores, seq_lens, ctrl, peer0, peer1, peer2, peer3, peer4,
                                 peer5, peer6, peer7, topk, rank, world, query_len,
                                 global_blocks, init_blocks, local_blocks, data_start, slot,
                                 peer_rank, npeers):
        chain_grids()
        epoch_box = cuda.shared.array(1, int64)
        epoch = open_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7,
                              npeers, peer_rank, epoch_box)
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, count, ctx = shard_row(scores, request_len, rank, world, query_len,
                                          global_blocks, init_blocks, local_blocks)
        block_topk(scores, ctx, count, topk, sel, hist, state)
        base = delivery_base(data_start, epoch, npeers, peer_rank, slot, head, row,
                             scores.shape[1], topk)
        for j in range(cuda.threadIdx.x, topk, cuda.blockDim.x):
            deliver_key(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, npeers, base + j,
                        sel[j])
        close_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, npeers,
                       peer_rank, epoch)

    return shard_topk_keys_to_peers


@cuda.jit(device=True)
def write_ids(sel, topk_idx, head, row, valid_blocks):
    """The row's top keys in ``sel`` -> block ids (or -1), into ``topk_idx`` and ``sel``."""
    topk = topk_idx.shape[2]
    kept = min(topk, valid_blocks)
    for j in range(cuda.threadIdx.x, topk, cuda.blockDim.x):
        block = merged_block(sel[j], j, kept)
        topk_idx[head, row, j] = block
        sel[j] = block
    cuda.syncthreads()


@lru_cache(maxsize=None)
def _merge_select(capacity):
    block_topk = make_block_topk(gathered_candidate_key, capacity)

    @cuda.jit(device=True)
    def merge_select(keys, first, world, topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, sel, hist, state):
        """Merge this block's (head, row) from ``keys[first:first + world]``; leaves
        its block ids (or -1) in ``sel[0:topk]``."""
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, request, causal_len, valid_blocks, count, ctx = gathered_row(
            keys, first, world, request_len, query_len, init_blocks, local_blocks)
        block_topk(keys, ctx, count, topk_idx.shape[2], sel, hist, state)
        write_ids(sel, topk_idx, head, row, valid_blocks)
        return head, row, request, causal_len

    return merge_select


@lru_cache(maxsize=None)
def _whole_row_select(capacity):
    block_topk = make_block_topk(shard_candidate_key, capacity)

    @cuda.jit(device=True)
    def whole_row_select(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks,
                         local_blocks, sel, hist, state):
        """World 1: this block's (head, row) top-k straight from the scores; leaves its
        block ids (or -1) in ``sel[0:topk]``."""
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, request, causal_len, valid_blocks, count, ctx = whole_row(
            scores, request_len, query_len, global_blocks, init_blocks, local_blocks)
        block_topk(scores, ctx, count, topk_idx.shape[2], sel, hist, state)
        write_ids(sel, topk_idx, head, row, valid_blocks)
        return head, row, request, causal_len

    return whole_row_select


@lru_cache(maxsize=None)
def _ids_table_writer(capacity):
    slots = max(1, capacity // WARP_LANES)  # sel[0:capacity] spread over one warp's lanes
    write_table = table_writer(slots)

    @cuda.jit(device=True)
    def write_ids_table(sel, topk, causal_len, request, head, row, block_table, page_stride,
                        sparse_table, context_lens):
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            # 32-bit: the table holds int32 page ids, so only the low 32 bits of a page
            # ever reach it; at sort tile 2048 (32 slots a lane) int64 arrays took 128
            # registers a lane and spilled.
            blocks = cuda.local.array(slots, int32)
            pages = cuda.local.array(slots, int32)
            for s in range(slots):
                e = lane * slots + s
                blocks[s] = sel[e] if e < topk else int64(-1)
            write_table(blocks, pages, topk, causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens, lane)

    return write_ids_table


@lru_cache(maxsize=None)
def _merge_with_table(capacity):
    merge_select = _merge_select(capacity)
    write_ids_table = _ids_table_writer(capacity)

    @cuda.jit(device=True)
    def merge_with_table(keys, first, world, topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, sel,
                         hist, state):
        head, row, request, causal_len = merge_select(keys, first, world, topk_idx, seq_lens,
                                                      query_len, init_blocks, local_blocks, sel,
                                                      hist, state)
        write_ids_table(sel, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens)

    return merge_with_table


@lru_cache(maxsize=None)
def select_kernel(capacity):
    """World 1 in one kernel: the scores' global top-k block ids."""
    select = _whole_row_select(capacity)

    @cuda.jit
    @declare(*SELECT_PARAMS, chained=True)
    def global_topk_ids(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks,
                        local_blocks):
        chain_grids()
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        select(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks, local_blocks,
               sel, hist, state)

    return global_topk_ids


@lru_cache(maxsize=None)
def select_table_kernel(capacity):
    """World 1 in one kernel: the global top-k block ids and the sparse table."""
    select = _whole_row_select(capacity)
    write_ids_table = _ids_table_writer(capacity)

    @cuda.jit
    @declare(*SELECT_TABLE_PARAMS, chained=True)
    def global_topk_ids_and_table(scores, seq_lens, topk_idx, block_table, sparse_table,
                                  context_lens, query_len, global_blocks, init_blocks,
                                  local_blocks, page_stride):
        chain_grids()
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        head, row, request, causal_len = select(scores, seq_lens, topk_idx, query_len,
                                                global_blocks, init_blocks, local_blocks, sel,
                                                hist, state)
        write_ids_table(sel, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens)

    return global_topk_ids_and_table


@lru_cache(maxsize=None)
def merge_kernel(capacity):
    merge_select = _merge_select(capacity)

    @cuda.jit
    @declare(*MERGE_PARAMS, chained=True)
    def merge_topk_ids(keys, topk_idx, seq_lens, query_len, init_blocks, local_blocks):
        chain_grids()
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_select(keys, 0, keys.shape[0], topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, sel, hist, state)

    return merge_topk_ids


@lru_cache(maxsize=None)
def merge_table_kernel(capacity):
    merge_with_table = _merge_with_table(capacity)

    @cuda.jit
    @declare(*MERGE_TABLE_PARAMS, chained=True)
    def merge_topk_ids_and_table(keys, topk_idx, seq_lens, block_table, sparse_table,
                                 context_lens, query_len, init_blocks, local_blocks,
                                 page_stride):
        chain_grids()
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_with_table(keys, 0, keys.shape[0], topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, sel,
                         hist, state)

    return merge_topk_ids_and_table


@lru_cache(maxsize=None)
def _merge_keys_select(capacity):
    block_topk = make_block_topk(gathered_candidate_key, capacity)

    @cuda.jit(device=True)
    def merge_keys_select(keys, first, world, out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, sel, hist, state):
        """Merge this block's (head, row) from ``keys[first:first + world]``; writes the
        top ``topk`` keys into ``out``."""
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, _, _, _, count, ctx = gathered_row(keys, first, world, request_len, query_len,
                                                      init_blocks, local_blocks)
        block_topk(keys, ctx, count, topk, sel, hist, state)
        for j in range(cuda.threadIdx.x, topk, cuda.blockDim.x):
            out[head, row, j] = sel[j]

    return merge_keys_select


@lru_cache(maxsize=None)
def merge_keys_kernel(capacity):
    """The two-level exchange's first merge: gathered keys -> the top ``topk`` keys."""
    merge_keys_select = _merge_keys_select(capacity)

    @cuda.jit
    @declare(*MERGE_KEYS_PARAMS, chained=True)
    def merge_topk_keys_to_keys(keys, out, seq_lens, topk, query_len, init_blocks,
                                local_blocks):
        chain_grids()
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_keys_select(keys, 0, keys.shape[0], out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, sel, hist, state)

    return merge_topk_keys_to_keys


@lru_cache(maxsize=None)
def merge_delivered_keys_kernel(capacity):
    """The fused node level's merge: wait, then the delivered keys -> the top ``topk`` keys."""
    merge_keys_select = _merge_keys_select(capacity)

    @cuda.jit
    @declare(*MERGE_DELIVERED_KEYS_PARAMS, chained=True)
    def merge_delivered_topk_keys(keys, out, seq_lens, ctrl, flags, errors, topk, query_len,
                                  init_blocks, local_blocks, timeout_ns, block_wait):
        chain_grids()
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_keys_select(keys, first, world, out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, sel, hist, state)

    return merge_delivered_topk_keys


@lru_cache(maxsize=None)
def merge_delivered_kernel(capacity):
    merge_select = _merge_select(capacity)

    @cuda.jit
    @declare(*MERGE_DELIVERED_PARAMS, chained=True)
    def merge_delivered_topk_ids(keys, topk_idx, seq_lens, ctrl, flags, errors, query_len,
                                 init_blocks, local_blocks, timeout_ns, block_wait):
        chain_grids()
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_select(keys, first, world, topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, sel, hist, state)

    return merge_delivered_topk_ids


@lru_cache(maxsize=None)
def merge_delivered_table_kernel(capacity):
    merge_with_table = _merge_with_table(capacity)

    @cuda.jit
    @declare(*MERGE_DELIVERED_TABLE_PARAMS, chained=True)
    def merge_delivered_topk_ids_and_table(keys, topk_idx, seq_lens, ctrl, flags, errors,
                                           block_table, sparse_table, context_lens, query_len,
                                           init_blocks, local_blocks, page_stride, timeout_ns,
                                           block_wait):
        chain_grids()
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_with_table(keys, first, world, topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, sel,
                         hist, state)

    return merge_delivered_topk_ids_and_table
