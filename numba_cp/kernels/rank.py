"""The rank family: exact top-k of short rows by counting (``method="rank"``).

Every key's place in the row's order is the number of keys above it, and
keys at places ``< topk`` are the answer, already sorted. A block of
``threads`` threads holds a row of up to ``threads * slots`` candidates, one
per thread and slot, so the work is spread over all of the block's warps and
every thread's comparisons are independent of each other.

Why: on the exchange's smallest rows (64 to 256 candidates) the warp family
spends most of its time in the dependent chain of its sorting network, a
shuffle and a compare-select per stage, ~20 stages deep, one warp per row.
Counting issues the same number of compares or more, but none waits on
another, and a row's warps share the work.

Algorithm, for a compile-time ``run`` (a power of two >= topk) and ``chunk``
(a power of two, ``run <= chunk <= threads * slots``):

1. every key is tagged below its 49 bits with its index (``key << 14 |
   (16383 - i)``), so all tagged keys differ, ties resolve to the lower
   index, and one compare orders two keys (of their bits read as float64,
   one instruction). The tagged keys go to shared memory;
2. within each chunk of ``chunk`` consecutive keys, a key's place is the
   number of the chunk's keys above it; the chunk's ``run`` first places
   land in shared memory in order (a sorted run per chunk);
3. with more than one chunk, a survivor's place in the row is the number of
   keys above it in all the runs, its own included (the runs are sorted, so
   two rounds of reads find it in each: the groups of ~sqrt(run) keys wholly
   above, then the keys above in the next group);
4. every thread writes its own keys whose places are below ``topk`` straight
   to the outputs: no gather, no barrier. The sparse-table writer, a scan
   over one warp's lanes, gets the top ``run`` in warp 0's registers in the
   warp family's element order instead, through shared memory.

``presorted`` (the merge's gathered keys: descending runs of ``run``
consecutive keys when ``per_shard == run``) skips step 2: step 3 reads the
runs where they are while a check that they are in order runs beside it,
and if one is not, the row is ranked as usual (chunks of ``run``).
"""

from functools import lru_cache

from numba import int32, int64, uint64

from ..backend import cuda
from .primitives import WARP_LANES, bits_as_float64, block_any, inline_device
from .shells import KERNELS, Selection, kernel_factories

__all__ = ["make_rank_topk", "selection", "TAG_BITS", "MAX_CAPACITY", *KERNELS]

# Keys have 49 bits (SPEC.md), so a tagged key is below 2**63, and its bits 52-62
# (the valid bit and the top of the ordered score, at most +inf's 0xFF800000)
# are never all set: as a float64 it is finite (primitives.bits_as_float64).
TAG_BITS = 14
MAX_CAPACITY = 1 << TAG_BITS
_TAG_TOP = MAX_CAPACITY - 1


def _log2(n):
    return n.bit_length() - 1


@lru_cache(maxsize=None)
def make_rank_topk(load, key_of, run, slots, threads, chunk, presorted=False,
                   warp_layout=False):
    """``(prefetch, rank_topk)`` for one candidate source (kernels/rows.py), with
    the calling convention of :func:`numba_cp.kernels.warp.make_warp_topk`.

    Afterwards each thread's ``acc[s]`` is a key and ``v[s]`` its place in
    the row's order, for its ``slots`` candidates (places ``>= run``: not
    among the top ``run``); with ``warp_layout``, warp 0's lanes hold the
    places in element order instead, as the warp family leaves them (one
    more barrier, but for presorted runs found in order: their vote's barrier
    serves), and each candidate's ``t[s]`` (set by the caller for slot
    ``s``, candidate ``s * threads + tid``) moves with its key. ``shared`` is a
    shared int64 array of ``3 * threads * slots + 1 + run``; ``raw``, ``v``,
    ``t`` and ``acc`` local arrays of ``slots``.
    ``count <= threads * slots``: the host picks this family only for rows
    that fit.
    """
    capacity = threads * slots
    if presorted:
        chunk = run
    if not (run <= chunk <= capacity <= MAX_CAPACITY and WARP_LANES * slots >= run
            and threads % WARP_LANES == 0
            and all(n & (n - 1) == 0 for n in (run, chunk, slots, threads))):
        raise ValueError(f"no rank top-k for run={run}, slots={slots}, threads={threads}, "
                         f"chunk={chunk}")
    chunks = capacity // chunk
    log_run = _log2(run)
    log_chunk = _log2(chunk)
    flag = 2 * capacity  # presorted: whether a run was out of order
    carried = flag + 1  # warp_layout: the t of the top run, by place
    payloads = carried + run  # warp_layout: every candidate's t, by index
    group = 1 << ((log_run + 1) >> 1)  # search_above's groups: about sqrt(run) keys each
    groups = run // group

    @inline_device
    def prefetch(src, place, room, raw):
        tid = cuda.threadIdx.x
        for s in range(slots):
            i = s * threads + tid  # a warp's loads are consecutive: they coalesce
            if i < room:
                raw[s] = load(src, place, i)

    @inline_device
    def count_above(shared, first, length, mine):
        """Keys above ``mine`` among ``shared[first:first + length]``, all of them
        compared (independent compares, so they issue back to back)."""
        bound = bits_as_float64(mine)  # one compare per key (see bits_as_float64)
        # Four 32-bit partial counts: one running count would chain every compare's
        # add on the one before (and Numba would widen a sum to 64 bits).
        c0 = int32(0)
        c1 = int32(0)
        c2 = int32(0)
        c3 = int32(0)
        whole = length - (length & 3)
        for j in range(0, whole, 4):
            # Unsigned indices: Numba wraps a signed one around for negative values.
            base = first + uint64(j)
            c0 = int32(c0 + int32(bits_as_float64(shared[base]) > bound))
            c1 = int32(c1 + int32(bits_as_float64(shared[base + uint64(1)]) > bound))
            c2 = int32(c2 + int32(bits_as_float64(shared[base + uint64(2)]) > bound))
            c3 = int32(c3 + int32(bits_as_float64(shared[base + uint64(3)]) > bound))
        for j in range(whole, length):
            c0 = int32(c0 + int32(bits_as_float64(shared[first + uint64(j)]) > bound))
        return int64(int32(int32(c0 + c1) + int32(c2 + c3)))

    @inline_device
    def search_above(shared, first, mine):
        """Keys above ``mine`` in the descending run ``shared[first:first + run]``.

        Two rounds of independent reads, not ``log2 run`` dependent ones: the
        last key of every group of ``group`` says how many whole groups lie
        above ``mine``, then the first group not wholly above is counted.
        """
        bound = bits_as_float64(mine)
        whole = int32(0)
        for j in range(groups):
            whole = int32(whole + int32(
                bits_as_float64(shared[first + uint64(j * group + group - 1)]) > bound))
        partial = min(whole, int32(groups - 1))  # past the last group: count the last one
        base = first + uint64(partial * group)
        above = int32(partial * group + (whole - partial))
        for m in range(group - 1):
            above = int32(above + int32(bits_as_float64(shared[base + uint64(m)]) > bound))
        return int64(above)

    @inline_device
    def rank_in_chunks(shared, source, target, v, acc):
        """Step 2: each of the thread's keys at ``shared[source:]`` gets its place
        in its chunk (``v``); the first ``run`` of each chunk are written, in
        order, at ``shared[target + c * run:]``."""
        tid = cuda.threadIdx.x
        for s in range(slots):
            i = s * threads + tid
            mine = shared[uint64(source + i)]
            place = count_above(shared, uint64(source + ((i >> log_chunk) << log_chunk)), chunk,
                                mine)
            acc[s] = mine
            v[s] = place
            if chunks > 1 and place < run:  # one chunk: the places are final
                shared[uint64(target + ((i >> log_chunk) << log_run) + place)] = mine

    @inline_device
    def place_in_runs(shared, source, v, acc):
        """Step 3: each of the thread's survivors in the ``chunks`` sorted runs at
        ``shared[source:]`` gets its place among all of them (``v``, ``acc``).
        Its own run counts too: there the keys above it are its position."""
        tid = cuda.threadIdx.x
        for s in range(slots):
            p = s * threads + tid
            place = int64(run)
            mine = int64(0)
            if p < chunks * run:
                mine = shared[uint64(source + p)]
                place = int64(0)
                for c in range(chunks):  # independent searches: their loads overlap
                    place += search_above(shared, uint64(source + (c << log_run)), mine)
            v[s] = place
            acc[s] = mine

    @inline_device
    def rank_everything(shared, v, acc):
        """Steps 2 and 3 over the keys at ``shared[0:capacity]``; returns where a
        region of ``run`` entries is free for the warp layout."""
        rank_in_chunks(shared, 0, capacity, v, acc)
        if chunks > 1:
            cuda.syncthreads()
            place_in_runs(shared, capacity, v, acc)
            return 0
        return capacity

    @inline_device
    def lay_out(shared, free, v, acc):
        """The thread's keys among the top ``run`` at ``shared[free + place]``, each
        with its payload at ``shared[carried + place]``, for warp 0 to read."""
        for s in range(slots):
            if v[s] < run:
                shared[uint64(free + v[s])] = acc[s]
                shared[uint64(carried + v[s])] = shared[
                    uint64(payloads + _TAG_TOP - (acc[s] & _TAG_TOP))]

    @inline_device
    def rank_topk(src, ctx, count, raw, v, t, acc, shared):
        tid = cuda.threadIdx.x
        for s in range(slots):
            i = s * threads + tid
            key = key_of(raw[s], ctx, i) if i < count else int64(0)
            shared[uint64(i)] = (key << TAG_BITS) | (_TAG_TOP - i)
            if warp_layout:  # a key may change threads on its way: its t waits here
                shared[uint64(payloads + i)] = t[s]
        if presorted and tid == 0:
            shared[flag] = 0
        cuda.syncthreads()
        # With warp_layout each thread writes its keys of the top run by place, and warp 0
        # reads them back after a barrier. A presorted row writes them as the runs place
        # them before its vote, whose barrier is then the one warp 0 waits for; only a
        # row that turns out disordered writes them again, ranked.
        free = capacity  # past the row's keys: the layout of a row taken as sorted
        ranked = True
        if presorted:
            disordered = False
            for s in range(slots):
                i = s * threads + tid
                if (i & (run - 1)) != 0 and shared[uint64(i - 1)] < shared[uint64(i)]:
                    disordered = True
            # Place the keys as if the runs were sorted before the check's verdict.
            place_in_runs(shared, 0, v, acc)
            if warp_layout:
                lay_out(shared, free, v, acc)
            ranked = block_any(disordered, shared[flag:flag + 1])
        if ranked:
            free = rank_everything(shared, v, acc)
            if warp_layout:
                lay_out(shared, free, v, acc)
                cuda.syncthreads()
        if warp_layout:
            for s in range(slots):
                e = tid * slots + s
                if tid < WARP_LANES and e < run:
                    acc[s] = shared[uint64(free + e)]
                    t[s] = shared[uint64(carried + e)]
                    v[s] = e
                else:
                    acc[s] = 0
                    v[s] = run
        for s in range(slots):
            acc[s] >>= TAG_BITS

    return prefetch, rank_topk


# The rank kernels read a shard's scores with unsigned indices, as every family does
# (rows.shard_load). By address, on one H100 in one process on the same arrays, in two
# machine starts (BENCHMARKS.md, "Small rows, 2026-12-07: unsigned score loads"), a's
# pack read 1.40 us against 1.46 with signed ones, a's world-1 kernel 2.13 against 2.23
# and b's pack 2.21 against 2.22. With Numba's array parameters, on the H200 on
# 2026-12-06, signed ones had been the faster (a's pack 1.92 against 2.10 us).


@lru_cache(maxsize=None)
def selection(run, slots, threads, chunk):
    """The rank family's :class:`~.shells.Selection` for one launch shape."""

    def make(load, key_of, presorted=False, warp_layout=False):
        return make_rank_topk(load, key_of, run, slots, threads, chunk, presorted,
                              warp_layout)

    @inline_device
    def candidate(s):
        return s * threads + cuda.threadIdx.x

    return Selection(make, slots, 3 * threads * slots + 1 + run, "rank", candidate, threads)


# Kernel factories: ``pack_kernel(run, slots, threads, chunk)`` and so on (kernels/shells.py).
(pack_kernel, merge_kernel, merge_table_kernel, merge_keys_kernel, select_kernel,
 select_table_kernel, pack_to_peers_kernel, merge_delivered_kernel, merge_delivered_table_kernel,
 merge_delivered_keys_kernel, merge_table_addressed_kernel,
 pack_addressed_kernel) = kernel_factories(selection)
