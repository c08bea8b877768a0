"""The exchange's kernels: shard top-k keys, and the per-head merge (+ sparse table).

Launch shape for all of them: ``grid = (tokens, heads)``, one block per
``(head, row)``. Two families, same results:

- ``*_warp`` (:mod:`.warp_select`): ``warps`` whole warps per block, built per
  ``(run, slots, warps)``; the fast one, for ``topk <= WARP_LANES * 16``.
- radix (:mod:`.select`): any number of threads, built per shared capacity (a
  power of two); for any ``topk``.

Kernels are cached per compile-time shape.
"""

from functools import lru_cache

from numba import int32, int64

from ..backend import cuda
from ..constants import PAGES, SPARSE_BLOCK
from .keys import causal_len_of, repin_key, score_key, valid_blocks_of
from .primitives import WARP_LANES, inline_device, lane_value
from .select import SCRATCH, STATE_SLOTS, make_block_topk
from .warp_select import make_warp_topk

# ctx tuples handed to the candidate functions
# shard:    (head, row, rank, world, init_blocks, local_start)
# gathered: (head, row, per_shard, log2(per_shard) or -1, init_blocks, local_start)


@cuda.jit(device=True, inline=True)
def shard_candidate_key(scores, ctx, column):
    head, row, rank, world, init_blocks, local_start = ctx
    block = column * world + rank
    return score_key(scores[head, row, column], block, init_blocks, local_start)


@cuda.jit(device=True, inline=True)
def gathered_candidate_key(keys, ctx, i):
    head, row, per_shard, shift, init_blocks, local_start = ctx
    if shift >= 0:  # per_shard is a power of two (it usually is topk): no division
        rank = i >> shift
        column = i & (per_shard - 1)
    else:
        rank = i // per_shard
        column = i - rank * per_shard
    key = keys[rank, head, row, column]
    if key == 0:
        return int64(0)
    return repin_key(key, init_blocks, local_start)


@cuda.jit(device=True, inline=True)
def shard_candidate_count(valid_blocks, global_blocks, rank, world, local):
    """Local columns ``j`` whose block ``j * world + rank`` is valid for the row."""
    limit = min(valid_blocks, global_blocks)
    if limit <= rank:
        return int64(0)
    return min((limit - rank + world - 1) // world, local)


@cuda.jit(device=True, inline=True)
def row_window(seq_lens, row, query_len, local_blocks):
    request = row // query_len
    causal_len = causal_len_of(seq_lens[request], row - request * query_len, query_len)
    valid_blocks = valid_blocks_of(causal_len)
    return request, causal_len, valid_blocks, max(valid_blocks - local_blocks, 0)


@cuda.jit(device=True, inline=True)
def per_shard_shift(per_shard):
    """log2(per_shard) when it is a power of two, else -1 (see gathered_candidate_key)."""
    shift = int64(-1)
    if per_shard & (per_shard - 1) == 0:
        shift = 0
        while (int64(1) << shift) < per_shard:
            shift += 1
    return shift


@cuda.jit(device=True, inline=True)
def shard_row(scores, seq_lens, rank, world, query_len, global_blocks, init_blocks,
              local_blocks):
    """This block's ``(head, row)``, its shard candidate count and candidate ctx."""
    row = int64(cuda.blockIdx.x)
    head = int64(cuda.blockIdx.y)
    _, _, valid_blocks, local_start = row_window(seq_lens, row, query_len, local_blocks)
    count = shard_candidate_count(valid_blocks, global_blocks, rank, world, scores.shape[2])
    return head, row, count, (head, row, rank, world, init_blocks, local_start)


@cuda.jit(device=True, inline=True)
def gathered_row(keys, seq_lens, head, row, query_len, init_blocks, local_blocks):
    """``(request, causal_len, valid_blocks, candidates, ctx)`` of a merge row."""
    request, causal_len, valid_blocks, local_start = row_window(seq_lens, row, query_len,
                                                                local_blocks)
    per_shard = int64(keys.shape[3])
    ctx = (head, row, per_shard, per_shard_shift(per_shard), init_blocks, local_start)
    return request, causal_len, valid_blocks, keys.shape[0] * per_shard, ctx


@cuda.jit(device=True, inline=True)
def merged_block(key, position, kept):
    """Block id of the merged key at ``position``, or -1 past ``kept`` or for key 0."""
    return (key & 0xFFFF) - 1 if (position < kept and key != 0) else int64(-1)


@lru_cache(maxsize=None)
def shard_topk_kernel(capacity):
    block_topk = make_block_topk(shard_candidate_key, capacity)

    @cuda.jit
    def shard_topk_keys(scores, seq_lens, out, topk, rank, world, query_len,
                        global_blocks, init_blocks, local_blocks):
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        head, row, count, ctx = shard_row(scores, seq_lens, rank, world, query_len,
                                          global_blocks, init_blocks, local_blocks)
        block_topk(scores, ctx, count, topk, sel, hist, state)
        for j in range(cuda.threadIdx.x, topk, cuda.blockDim.x):
            out[head, row, j] = sel[j]

    return shard_topk_keys


@lru_cache(maxsize=None)
def _merge_select(capacity):
    block_topk = make_block_topk(gathered_candidate_key, capacity)

    @cuda.jit(device=True)
    def merge_select(keys, seq_lens, topk_idx, head, row, query_len, init_blocks, local_blocks,
                     sel, hist, state):
        """Merge one (head, row); leaves its block ids (or -1) in ``sel[0:topk]``."""
        topk = topk_idx.shape[2]
        _, causal_len, valid_blocks, count, ctx = gathered_row(keys, seq_lens, head, row,
                                                               query_len, init_blocks,
                                                               local_blocks)
        block_topk(keys, ctx, count, topk, sel, hist, state)
        kept = min(topk, valid_blocks)
        for j in range(cuda.threadIdx.x, topk, cuda.blockDim.x):
            block = merged_block(sel[j], j, kept)
            topk_idx[head, row, j] = block
            sel[j] = block
        cuda.syncthreads()
        return causal_len

    return merge_select


@lru_cache(maxsize=None)
def merge_topk_kernel(capacity):
    merge_select = _merge_select(capacity)

    @cuda.jit
    def merge_topk_ids(keys, seq_lens, topk_idx, query_len, init_blocks, local_blocks):
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        merge_select(keys, seq_lens, topk_idx, int64(cuda.blockIdx.y), int64(cuda.blockIdx.x),
                     query_len, init_blocks, local_blocks, sel, hist, state)

    return merge_topk_ids


@cuda.jit(device=True)
def write_sparse_table(blocks, topk, causal_len, request, head, row, block_table, page_stride,
                       sparse_table, context_lens, slots, state):
    """SPEC.md's paged sparse block table for one (head, row) from its merged ``blocks``.

    ``slots`` (shared, >= topk) receives the block of each used output slot.
    """
    tid = cuda.threadIdx.x
    ctx_len = max(causal_len, 0)
    self_blk = (causal_len - 1) // SPARSE_BLOCK
    if tid == 0:
        n_full = 0
        has_tail = False
        for j in range(topk):
            b = blocks[j]
            if ctx_len > 0 and 0 <= b <= self_blk and b < block_table.shape[1]:
                if b < self_blk:
                    slots[n_full] = b
                    n_full += 1
                else:
                    has_tail = True
        n_used = n_full
        if has_tail:
            slots[n_full] = self_blk
            n_used += 1
            context_lens[head, row] = n_full * SPARSE_BLOCK + (ctx_len - self_blk * SPARSE_BLOCK)
        else:
            context_lens[head, row] = min(n_used * SPARSE_BLOCK, ctx_len)
        state[0] = n_used
    cuda.syncthreads()
    n_used = state[0]
    for entry in range(tid, topk * PAGES, cuda.blockDim.x):
        slot = entry // PAGES
        page = 0
        if slot < n_used:
            page = block_table[request, slots[slot]] * page_stride + entry % PAGES
        sparse_table[head, row, entry] = page


@lru_cache(maxsize=None)
def merge_sparse_table_kernel(capacity):
    merge_select = _merge_select(capacity)

    @cuda.jit
    def merge_topk_ids_and_table(keys, seq_lens, topk_idx, query_len, init_blocks, local_blocks,
                                 block_table, page_stride, sparse_table, context_lens):
        sel = cuda.shared.array(capacity, int64)
        hist = cuda.shared.array(SCRATCH, int32)
        state = cuda.shared.array(STATE_SLOTS, int64)
        slots = cuda.shared.array(capacity, int32)
        row = int64(cuda.blockIdx.x)
        head = int64(cuda.blockIdx.y)
        causal_len = merge_select(keys, seq_lens, topk_idx, head, row, query_len, init_blocks,
                                  local_blocks, sel, hist, state)
        write_sparse_table(sel, topk_idx.shape[2], causal_len, row // query_len, head, row,
                           block_table, page_stride, sparse_table, context_lens, slots, state)

    return merge_topk_ids_and_table


# ---------------------------------------------------------------------------
# Warp kernels: the row's top keys end in warp 0's registers (``acc``), element
# ``e = lane * slots + s``; warp 0 writes the outputs.


@lru_cache(maxsize=None)
def shard_topk_warp_kernel(run, slots, warps):
    warp_topk = make_warp_topk(shard_candidate_key, run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    def shard_topk_keys_warp(scores, seq_lens, out, topk, rank, world, query_len,
                             global_blocks, init_blocks, local_blocks):
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        head, row, count, ctx = shard_row(scores, seq_lens, rank, world, query_len,
                                          global_blocks, init_blocks, local_blocks)
        warp_topk(scores, ctx, count, v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            for s in range(slots):
                e = lane * slots + s
                if e < topk:
                    out[head, row, e] = acc[s]

    return shard_topk_keys_warp


@lru_cache(maxsize=None)
def _merge_warp_select(run, slots, warps):
    warp_topk = make_warp_topk(gathered_candidate_key, run, slots, warps, presorted=True)

    @inline_device
    def merge_warp_select(keys, seq_lens, topk_idx, head, row, query_len, init_blocks,
                          local_blocks, v, t, acc, shared):
        """Merge one (head, row); warp 0 writes topk_idx and keeps the ids in ``acc``."""
        request, causal_len, valid_blocks, count, ctx = gathered_row(keys, seq_lens, head, row,
                                                                     query_len, init_blocks,
                                                                     local_blocks)
        warp_topk(keys, ctx, count, v, t, acc, shared)
        topk = topk_idx.shape[2]
        kept = min(topk, valid_blocks)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            for s in range(slots):
                e = lane * slots + s
                block = merged_block(acc[s], e, kept)
                acc[s] = block
                if e < topk:
                    topk_idx[head, row, e] = block
        return request, causal_len

    return merge_warp_select


@lru_cache(maxsize=None)
def merge_topk_warp_kernel(run, slots, warps):
    merge_select = _merge_warp_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    def merge_topk_ids_warp(keys, seq_lens, topk_idx, query_len, init_blocks, local_blocks):
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_select(keys, seq_lens, topk_idx, int64(cuda.blockIdx.y), int64(cuda.blockIdx.x),
                     query_len, init_blocks, local_blocks, v, t, acc, shared)

    return merge_topk_ids_warp


@lru_cache(maxsize=None)
def _warp_sparse_table(slots):
    @inline_device
    def write_sparse_table_warp(blocks, topk, causal_len, request, head, row, block_table,
                                page_stride, sparse_table, context_lens, lane):
        """SPEC.md's paged sparse block table from warp 0's merged ``blocks``.

        A used full block's output slot is the number of full blocks before it:
        an exclusive scan over the lanes (butterfly, so it needs only xor
        shuffles); the tail block takes the slot after the last full one.
        """
        ctx_len = max(causal_len, 0)
        self_blk = (causal_len - 1) // SPARSE_BLOCK
        columns = block_table.shape[1]
        full = int64(0)
        tail = int64(0)
        for s in range(slots):
            e = lane * slots + s
            b = blocks[s]
            if e < topk and ctx_len > 0 and 0 <= b <= self_blk and b < columns:
                if b < self_blk:
                    full += 1
                else:
                    tail = 1
        before = int64(0)  # full blocks in lower lanes
        total = full
        tails = tail
        mask = 1
        while mask < WARP_LANES:
            other_total = lane_value(total, lane, mask)
            other_tails = lane_value(tails, lane, mask)
            if lane & mask:
                before += other_total
            total += other_total
            tails |= other_tails
            mask <<= 1
        n_full = total
        n_used = n_full + tails
        if lane == 0:
            if tails:
                context_lens[head, row] = n_full * SPARSE_BLOCK + (ctx_len - self_blk * SPARSE_BLOCK)
            else:
                context_lens[head, row] = min(n_used * SPARSE_BLOCK, ctx_len)
        pages = cuda.local.array(slots, int64)  # all page lookups in flight at once
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
                pages[s] = block_table[request, b] * page_stride
            blocks[s] = slot
        for s in range(slots):
            e = lane * slots + s
            slot = blocks[s]
            if slot >= 0:
                for p in range(PAGES):
                    sparse_table[head, row, slot * PAGES + p] = pages[s] + p
            if n_used <= e < topk:
                for p in range(PAGES):
                    sparse_table[head, row, e * PAGES + p] = 0

    return write_sparse_table_warp


@lru_cache(maxsize=None)
def merge_sparse_table_warp_kernel(run, slots, warps):
    merge_select = _merge_warp_select(run, slots, warps)
    write_table = _warp_sparse_table(slots)
    shared_size = warps * run

    @cuda.jit
    def merge_topk_ids_and_table_warp(keys, seq_lens, topk_idx, query_len, init_blocks,
                                      local_blocks, block_table, page_stride, sparse_table,
                                      context_lens):
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        row = int64(cuda.blockIdx.x)
        head = int64(cuda.blockIdx.y)
        request, causal_len = merge_select(keys, seq_lens, topk_idx, head, row, query_len,
                                           init_blocks, local_blocks, v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            write_table(acc, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens, lane)

    return merge_topk_ids_and_table_warp
