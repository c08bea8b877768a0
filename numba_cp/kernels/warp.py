"""The warp family: exact top-k of int64 keys by warps, in registers (``method="warp"``).

Bitonic runs, then merge-halving; the pack, merge and merge + sparse table
kernels at the end are built from it per compile-time shape ``(run, slots, warps)``.

Why: the exchange's rows are short (tens to a few thousand candidates) and
there are few of them, so a kernel's time is its longest dependency chain,
not its bandwidth. A warp sorting in registers needs no block barriers, no
shared-memory round trips and no serial thread: every step is a handful of
independent compare-selects per lane, or one register shuffle.

Layout: a warp holds ``N = WARP_LANES * M`` keys, ``M`` per lane in a local
array that the unrolled code keeps in registers. Element ``e = lane * M + s``
is slot ``s`` of lane ``lane``; partners ``e ^ mask`` are in the same lane when
``mask < M`` and one shuffle away otherwise.

Algorithm (for a compile-time ``K``, a power of two >= topk, ``K <= N``):

1. sort every run of ``K`` elements descending (bitonic, "flip" form: the
   first step of each span compares ``e`` with ``e ^ (span - 1)``, so all runs
   sort the same way and no direction bookkeeping is needed);
2. halve: for span ``2K, 4K, ..., N``, ``v[e] = max(v[e], v[e ^ (span - 1)])``
   leaves in every run the ``K`` largest of its span as a bitonic sequence,
   which ``log2 K`` half-cleaner steps sort again. Afterwards every run holds
   the top ``K`` of the warp's ``N`` keys;
3. rows longer than one warp-pass stream through in chunks, each chunk's top
   ``K`` merged into an accumulator the same way (a max against the reversed
   run, then half-cleaners), so the cost is linear in the row length; with
   ``G`` warps per row the warps' results merge in a tree through shared
   memory (``log2 G`` barriers).

Ties (duplicate keys, which only malformed gathered input has) need no care:
a sorting network selects a multiset's top ``K`` exactly.

Every stage is its own device function with its masks as closure constants,
so after inlining each ``for s in range(M)`` unrolls to constant register
indices: no local memory, whatever the compiler's unroll heuristics (the PTX
of every shape has no ``.local`` depot).
"""

from functools import lru_cache

from numba import float32, int64

from ..backend import cuda
from .ipc import await_delivery, close_delivery, deliver_key, delivery_base, open_delivery
from .params import declare
from .primitives import WARP_LANES, inline_device, lane_exchange, lane_read, lanes_all
from .rows import (MERGE_DELIVERED_KEYS_PARAMS, MERGE_DELIVERED_PARAMS,
                   MERGE_DELIVERED_TABLE_PARAMS, MERGE_KEYS_PARAMS,
                   MERGE_PARAMS, MERGE_TABLE_PARAMS, PACK_PARAMS, PACK_TO_PEERS_PARAMS,
                   SELECT_PARAMS, SELECT_TABLE_PARAMS, gathered_key_of, gathered_load,
                   gathered_place, gathered_row, merged_block, shard_key_of, shard_load,
                   shard_place, shard_row, table_writer, whole_row)

__all__ = ["make_warp_topk", "pack_kernel", "merge_kernel", "merge_table_kernel",
           "merge_keys_kernel", "select_kernel", "select_table_kernel",
           "pack_to_peers_kernel", "merge_delivered_kernel", "merge_delivered_table_kernel",
           "merge_delivered_keys_kernel"]

LOG_LANES = WARP_LANES.bit_length() - 1


def _log2(n):
    return n.bit_length() - 1


@lru_cache(maxsize=None)
def compare_stage(slots, mask, max_only):
    """Compare element ``e`` with ``e ^ mask`` everywhere in the warp.

    The lower index keeps the larger key and the higher the smaller (a sorting
    step), or both keep the larger (``max_only``: a halving step).
    """
    slot_mask = mask & (slots - 1)
    lane_mask = mask >> _log2(slots)
    if lane_mask == 0:

        @inline_device
        def in_lane(v, t, lane):
            for s in range(slots):
                p = s ^ slot_mask
                if s < p:
                    a = v[s]
                    b = v[p]
                    if max_only:
                        v[s] = max(a, b)
                        v[p] = max(a, b)
                    elif a < b:
                        v[s] = b
                        v[p] = a

        return in_lane

    top_lane_bit = 1 << _log2(lane_mask)  # the partner bit that says which one is lower

    @inline_device
    def across_lanes(v, t, lane):
        lane_exchange(v, t, slots, lane, lane_mask)
        keep_larger = max_only or (lane & top_lane_bit) == 0
        for s in range(slots):
            # One comparison whose outcome the lane's side flips. Spelt as max/min,
            # LLVM keeps both and the GPU pays a 64-bit compare for each.
            b = t[s ^ slot_mask]
            if (b > v[s]) == keep_larger:
                v[s] = b

    return across_lanes


@lru_cache(maxsize=None)
def sequence(stages):
    """One device function calling ``stages`` (a tuple) in order.

    Generated as flat source so that Numba compiles one function per schedule,
    not one per step: compile time grows with the number of distinct stages.
    """
    names = [f"stage_{i}" for i in range(len(stages))]
    body = "".join(f"    {name}(v, t, lane)\n" for name in names) or "    pass\n"
    namespace = dict(zip(names, stages))
    exec(f"def run_stages(v, t, lane):\n{body}", namespace)  # noqa: S102 - names only
    return inline_device(namespace["run_stages"])


def half_cleaners(slots, run):
    """Sort every bitonic run of length ``run``: strides ``run / 2, ..., 1``."""
    stages = ()
    stride = run >> 1
    while stride >= 1:
        stages += (compare_stage(slots, stride, False),)
        stride >>= 1
    return stages


def sort_schedule(slots, run):
    """Bitonic sort of every run of length ``run``, descending (flip form)."""
    stages = ()
    span = 2
    while span <= run:
        stages += (compare_stage(slots, span - 1, False),)
        stages += half_cleaners(slots, span >> 1)
        span <<= 1
    return stages


def halve_schedule(slots, run, total):
    """Leave the top ``run`` of all ``total`` elements, sorted, in every run."""
    stages = ()
    span = run << 1
    while span <= total:
        stages += (compare_stage(slots, span - 1, True),)
        stages += half_cleaners(slots, run)
        span <<= 1
    return stages


@lru_cache(maxsize=None)
def reverse_runs(slots, run):
    """``t[s]`` = the element at ``e ^ (run - 1)``: each run read back to front."""
    slot_mask = (run - 1) & (slots - 1)
    lane_mask = (run - 1) >> _log2(slots)

    @inline_device
    def reverse(v, t, lane):
        if lane_mask == 0:
            for s in range(slots):
                t[s] = v[s ^ slot_mask]
        else:
            lane_exchange(v, t, slots, lane, lane_mask)
            if slot_mask != 0:  # a lane's slots come back in reverse: swap them in place
                for s in range(slots):
                    p = s ^ slot_mask
                    if s < p:
                        a = t[s]
                        t[s] = t[p]
                        t[p] = a

    return reverse


@lru_cache(maxsize=None)
def runs_sorted(slots, run):
    """Whether every run of the warp is already in descending order (warp-uniform)."""

    @inline_device
    def check(v, lane):
        ok = int64(1)
        for s in range(slots - 1):
            if ((lane * slots + s + 1) & (run - 1)) != 0 and v[s] < v[s + 1]:
                ok = 0
        following = lane_read(v[0], lane, (lane + 1) & (WARP_LANES - 1))
        if (lane < WARP_LANES - 1 and (((lane + 1) * slots) & (run - 1)) != 0
                and v[slots - 1] < following):
            ok = 0
        return lanes_all(ok != 0, lane)

    return check


@lru_cache(maxsize=None)
def make_warp_topk(load, key_of, run, slots, warps, presorted=False):
    """``(prefetch, warp_topk)`` for one candidate source (kernels/rows.py).

    ``prefetch(src, place, capacity, raw)`` loads this lane's candidates of
    the first pass, every ``i < capacity`` (the row's room in ``src``), into
    the local array ``raw``. ``place`` is a ctx without the window, so the
    loads need not wait for seq_lens: a kernel issues them first, then reads
    its window while they are in flight.

    ``warp_topk(src, ctx, count, raw, v, t, acc, shared)`` then selects:
    ``key_of(raw, ctx, i)`` is key ``i < count`` of the row (``count <=
    capacity``), from ``raw`` in the first pass and ``load(src, ctx, i)``
    after. No key at or past ``count`` is used (SPEC.md: those columns may
    hold garbage; what a speculative load fetched there is dropped unread).

    ``presorted``: the source usually holds descending runs of ``run``
    consecutive keys (the merge's gathered shard keys, when ``per_shard ==
    run``). Lanes then read consecutive keys, and a pass whose runs are all in
    order skips the sort; any other input is sorted as usual.

    The block is ``warps`` whole warps, all of them working on one row; ``v``, ``t`` and
    ``acc`` are local int64 arrays of ``slots`` elements, ``shared`` a shared
    int64 array of ``warps * run`` (unused when ``warps == 1``). Afterwards
    warp 0's ``acc`` holds the row's ``run`` largest keys in descending
    element order (``e = lane * slots + s``), padded with zeros.
    """
    width = WARP_LANES * slots
    if not (run <= width and run & (run - 1) == 0 and slots & (slots - 1) == 0
            and warps & (warps - 1) == 0):
        raise ValueError(f"no warp top-k for run={run}, slots={slots}, warps={warps}")
    sort_runs = sequence(sort_schedule(slots, run))
    halve = sequence(halve_schedule(slots, run, width))
    clean = sequence(half_cleaners(slots, run))
    reverse = reverse_runs(slots, run)
    in_order = runs_sorted(slots, run)
    log_pass = _log2(width * warps)
    log_width = _log2(width)

    @inline_device
    def candidate(step, lane, s):
        """Index of slot ``s`` of ``lane`` in pass ``step`` of this warp."""
        base = (step * warps + (cuda.threadIdx.x >> LOG_LANES)) << log_width
        if presorted:  # element order = key order, so sorted runs stay runs
            return base + lane * slots + s
        return base + s * WARP_LANES + lane  # slot-major reads: a warp's loads coalesce

    @inline_device
    def prefetch(src, place, capacity, raw):
        lane = cuda.threadIdx.x & (WARP_LANES - 1)
        for s in range(slots):
            i = candidate(0, lane, s)
            if i < capacity:
                raw[s] = load(src, place, i)

    @inline_device
    def keep_top(acc, v, t, lane):
        """``acc`` = the top ``run`` of ``acc`` and of the run that ``t`` holds reversed."""
        for s in range(slots):
            v[s] = max(acc[s], t[s])
        clean(v, t, lane)
        for s in range(slots):
            acc[s] = v[s]

    @inline_device
    def merge_into(acc, v, t, lane):
        """``acc`` = the top ``run`` of ``acc`` and ``v``, each sorted in every run."""
        reverse(v, t, lane)
        keep_top(acc, v, t, lane)

    @inline_device
    def warp_topk(src, ctx, count, raw, v, t, acc, shared):
        tid = cuda.threadIdx.x
        lane = tid & (WARP_LANES - 1)
        warp = tid >> LOG_LANES
        for s in range(slots):
            acc[s] = 0
        passes = (count + (width * warps - 1)) >> log_pass
        for step in range(passes):
            for s in range(slots):
                i = candidate(step, lane, s)
                if i < count:
                    v[s] = key_of(raw[s] if step == 0 else load(src, ctx, i), ctx, i)
                else:
                    v[s] = 0
            if not (presorted and in_order(v, lane)):
                sort_runs(v, t, lane)
            halve(v, t, lane)
            if step == 0:
                for s in range(slots):
                    acc[s] = v[s]
            else:
                merge_into(acc, v, t, lane)
        stride = 1
        while stride < warps:  # tree over the row's warps; all threads reach each barrier
            if warp & (2 * stride - 1) == stride:
                for s in range(slots):
                    e = lane * slots + s
                    if e < run:
                        shared[warp * run + e] = acc[s]
            cuda.syncthreads()
            if warp & (2 * stride - 1) == 0:
                partner = (warp + stride) * run
                for s in range(slots):  # the partner's run, read back to front
                    t[s] = shared[partner + (((lane * slots + s) & (run - 1)) ^ (run - 1))]
                keep_top(acc, v, t, lane)
            stride <<= 1

    return prefetch, warp_topk


# ---------------------------------------------------------------------------
# Kernels: a block of ``warps`` whole warps per (head, row). The row's top keys
# end in warp 0's registers (``acc``), element ``e = lane * slots + s``; warp 0
# writes the outputs. The "delivered" kernels are the fused IPC exchange's
# (protocol: kernels/ipc.py): the pack writes every rank's exchange buffer,
# the merge waits for its peers and reads its own buffer.


@lru_cache(maxsize=None)
def _shard_select(run, slots, warps):
    prefetch, warp_topk = make_warp_topk(shard_load, shard_key_of, run, slots, warps)

    @inline_device
    def shard_select(scores, seq_lens, rank, world, query_len, global_blocks, init_blocks,
                     local_blocks, raw, v, t, acc, shared):
        """Select this block's (head, row); warp 0's ``acc`` holds the keys."""
        prefetch(scores, shard_place(rank, world), scores.shape[2], raw)
        head, row, count, ctx = shard_row(scores, seq_lens, rank, world, query_len,
                                          global_blocks, init_blocks, local_blocks)
        warp_topk(scores, ctx, count, raw, v, t, acc, shared)
        return head, row

    return shard_select


@lru_cache(maxsize=None)
def pack_kernel(run, slots, warps):
    shard_select = _shard_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*PACK_PARAMS)
    def shard_topk_keys_warp(scores, seq_lens, out, topk, rank, world, query_len,
                             global_blocks, init_blocks, local_blocks):
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        head, row = shard_select(scores, seq_lens, rank, world, query_len, global_blocks,
                                 init_blocks, local_blocks, raw, v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            for s in range(slots):
                e = lane * slots + s
                if e < topk:
                    out[head, row, e] = acc[s]

    return shard_topk_keys_warp


@lru_cache(maxsize=None)
def pack_to_peers_kernel(run, slots, warps):
    shard_select = _shard_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*PACK_TO_PEERS_PARAMS)
    def shard_topk_keys_to_peers_warp(scores, seq_lens, ctrl, peer0, peer1, peer2, peer3,
                                      peer4, peer5, peer6, peer7, topk, rank, world, query_len,
                                      global_blocks, init_blocks, local_blocks, data_start,
                                      slot, peer_rank, npeers):
        epoch_box = cuda.shared.array(1, int64)
        epoch = open_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7,
                              npeers, peer_rank, epoch_box)
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        head, row = shard_select(scores, seq_lens, rank, world, query_len, global_blocks,
                                 init_blocks, local_blocks, raw, v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            base = delivery_base(data_start, epoch, npeers, peer_rank, slot, head, row,
                                 scores.shape[1], topk)
            for s in range(slots):
                e = lane * slots + s
                if e < topk:
                    deliver_key(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, npeers,
                                base + e, acc[s])
        close_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, npeers,
                       peer_rank, epoch)

    return shard_topk_keys_to_peers_warp


@lru_cache(maxsize=None)
def _ids_writer(slots):
    @inline_device
    def write_ids(acc, topk_idx, head, row, valid_blocks):
        """Warp 0: the row's top keys in ``acc`` -> block ids (or -1), into ``topk_idx``
        and back into ``acc``."""
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

    return write_ids


@lru_cache(maxsize=None)
def _merge_select(run, slots, warps):
    prefetch, warp_topk = make_warp_topk(gathered_load, gathered_key_of, run, slots, warps,
                                         presorted=True)
    write_ids = _ids_writer(slots)

    @inline_device
    def merge_select(keys, first, world, topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, raw, v, t, acc, shared):
        """Merge this block's (head, row) from ``keys[first:first + world]``; warp 0
        writes topk_idx and keeps the ids (or -1) in ``acc``."""
        prefetch(keys, gathered_place(keys, first), world * keys.shape[3], raw)
        head, row, request, causal_len, valid_blocks, count, ctx = gathered_row(
            keys, first, world, seq_lens, query_len, init_blocks, local_blocks)
        warp_topk(keys, ctx, count, raw, v, t, acc, shared)
        write_ids(acc, topk_idx, head, row, valid_blocks)
        return head, row, request, causal_len

    return merge_select


@lru_cache(maxsize=None)
def _whole_row_select(run, slots, warps):
    prefetch, warp_topk = make_warp_topk(shard_load, shard_key_of, run, slots, warps)
    write_ids = _ids_writer(slots)

    @inline_device
    def whole_row_select(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks,
                         local_blocks, raw, v, t, acc, shared):
        """World 1: this block's (head, row) top-k of pinned keys straight from the
        scores; warp 0 writes topk_idx and keeps the ids (or -1) in ``acc``."""
        prefetch(scores, shard_place(0, 1), scores.shape[2], raw)
        head, row, request, causal_len, valid_blocks, count, ctx = whole_row(
            scores, seq_lens, query_len, global_blocks, init_blocks, local_blocks)
        warp_topk(scores, ctx, count, raw, v, t, acc, shared)
        write_ids(acc, topk_idx, head, row, valid_blocks)
        return head, row, request, causal_len

    return whole_row_select


@lru_cache(maxsize=None)
def select_kernel(run, slots, warps):
    """World 1 in one kernel: the scores' global top-k block ids."""
    select = _whole_row_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*SELECT_PARAMS)
    def global_topk_ids_warp(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks,
                             local_blocks):
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        select(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks, local_blocks,
               raw, v, t, acc, shared)

    return global_topk_ids_warp


@lru_cache(maxsize=None)
def select_table_kernel(run, slots, warps):
    """World 1 in one kernel: the global top-k block ids and the sparse table."""
    select = _whole_row_select(run, slots, warps)
    write_table = table_writer(slots)
    shared_size = warps * run

    @cuda.jit
    @declare(*SELECT_TABLE_PARAMS)
    def global_topk_ids_and_table_warp(scores, seq_lens, topk_idx, block_table, sparse_table,
                                       context_lens, query_len, global_blocks, init_blocks,
                                       local_blocks, page_stride):
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        head, row, request, causal_len = select(scores, seq_lens, topk_idx, query_len,
                                                global_blocks, init_blocks, local_blocks,
                                                raw, v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            write_table(acc, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens, lane)

    return global_topk_ids_and_table_warp


@lru_cache(maxsize=None)
def _merge_with_table(run, slots, warps):
    merge_select = _merge_select(run, slots, warps)
    write_table = table_writer(slots)

    @inline_device
    def merge_with_table(keys, first, world, topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, raw, v,
                         t, acc, shared):
        head, row, request, causal_len = merge_select(
            keys, first, world, topk_idx, seq_lens, query_len, init_blocks, local_blocks, raw,
            v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            write_table(acc, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens, lane)

    return merge_with_table


@lru_cache(maxsize=None)
def merge_kernel(run, slots, warps):
    merge_select = _merge_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*MERGE_PARAMS)
    def merge_topk_ids_warp(keys, topk_idx, seq_lens, query_len, init_blocks, local_blocks):
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_select(keys, 0, keys.shape[0], topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, raw, v, t, acc, shared)

    return merge_topk_ids_warp


@lru_cache(maxsize=None)
def merge_table_kernel(run, slots, warps):
    merge_with_table = _merge_with_table(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*MERGE_TABLE_PARAMS)
    def merge_topk_ids_and_table_warp(keys, topk_idx, seq_lens, block_table, sparse_table,
                                      context_lens, query_len, init_blocks, local_blocks,
                                      page_stride):
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_with_table(keys, 0, keys.shape[0], topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, raw,
                         v, t, acc, shared)

    return merge_topk_ids_and_table_warp


@lru_cache(maxsize=None)
def _merge_keys_select(run, slots, warps):
    prefetch, warp_topk = make_warp_topk(gathered_load, gathered_key_of, run, slots, warps,
                                         presorted=True)

    @inline_device
    def merge_keys_select(keys, first, world, out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, raw, v, t, acc, shared):
        """Merge this block's (head, row) from ``keys[first:first + world]``; warp 0
        writes the top ``topk`` keys into ``out``."""
        prefetch(keys, gathered_place(keys, first), world * keys.shape[3], raw)
        head, row, _, _, _, count, ctx = gathered_row(keys, first, world, seq_lens,
                                                      query_len, init_blocks, local_blocks)
        warp_topk(keys, ctx, count, raw, v, t, acc, shared)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            for s in range(slots):
                e = lane * slots + s
                if e < topk:
                    out[head, row, e] = acc[s]

    return merge_keys_select


@lru_cache(maxsize=None)
def merge_keys_kernel(run, slots, warps):
    """The two-level exchange's first merge: gathered keys -> the top ``topk`` keys."""
    merge_keys_select = _merge_keys_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*MERGE_KEYS_PARAMS)
    def merge_topk_keys_to_keys_warp(keys, out, seq_lens, topk, query_len, init_blocks,
                                     local_blocks):
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_keys_select(keys, 0, keys.shape[0], out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, raw, v, t, acc, shared)

    return merge_topk_keys_to_keys_warp


@lru_cache(maxsize=None)
def merge_delivered_keys_kernel(run, slots, warps):
    """The fused node level's merge: wait, then the delivered keys -> the top ``topk`` keys."""
    merge_keys_select = _merge_keys_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*MERGE_DELIVERED_KEYS_PARAMS)
    def merge_delivered_topk_keys_warp(keys, out, seq_lens, ctrl, flags, errors, topk,
                                       query_len, init_blocks, local_blocks, timeout_ns,
                                       block_wait):
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_keys_select(keys, first, world, out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, raw, v, t, acc, shared)

    return merge_delivered_topk_keys_warp


@lru_cache(maxsize=None)
def merge_delivered_kernel(run, slots, warps):
    merge_select = _merge_select(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*MERGE_DELIVERED_PARAMS)
    def merge_delivered_topk_ids_warp(keys, topk_idx, seq_lens, ctrl, flags, errors,
                                      query_len, init_blocks, local_blocks, timeout_ns,
                                      block_wait):
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_select(keys, first, world, topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, raw, v, t, acc, shared)

    return merge_delivered_topk_ids_warp


@lru_cache(maxsize=None)
def merge_delivered_table_kernel(run, slots, warps):
    merge_with_table = _merge_with_table(run, slots, warps)
    shared_size = warps * run

    @cuda.jit
    @declare(*MERGE_DELIVERED_TABLE_PARAMS)
    def merge_delivered_topk_ids_and_table_warp(keys, topk_idx, seq_lens, ctrl, flags, errors,
                                                block_table, sparse_table, context_lens,
                                                query_len, init_blocks, local_blocks,
                                                page_stride, timeout_ns, block_wait):
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_with_table(keys, first, world, topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, raw,
                         v, t, acc, shared)

    return merge_delivered_topk_ids_and_table_warp
