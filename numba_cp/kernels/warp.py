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

from numba import int64, uint64

from ..backend import cuda
from .primitives import WARP_LANES, inline_device, lane_exchange, lane_read, lanes_all
from .shells import KERNELS, Selection, kernel_factories

__all__ = ["make_warp_topk", "selection", *KERNELS]

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
    element order (``e = lane * slots + s``), padded with zeros, and ``v``
    their places ``e`` (every other warp's: ``run``, none). This is the
    warp layout that kernels/shells.py may ask of a family, so the
    family's ``warp_layout`` switch has nothing to change here.
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
                        shared[uint64(warp * run + e)] = acc[s]
            cuda.syncthreads()
            if warp & (2 * stride - 1) == 0:
                partner = (warp + stride) * run
                for s in range(slots):  # the partner's run, read back to front
                    t[s] = shared[uint64(partner + (((lane * slots + s) & (run - 1)) ^ (run - 1)))]
                keep_top(acc, v, t, lane)
            stride <<= 1
        for s in range(slots):
            v[s] = lane * slots + s if warp == 0 else run

    return prefetch, warp_topk


@lru_cache(maxsize=None)
def selection(run, slots, warps):
    """The warp family's :class:`~.shells.Selection` for one launch shape."""

    def make(load, key_of, presorted=False, warp_layout=False):
        return make_warp_topk(load, key_of, run, slots, warps, presorted)

    return Selection(make, slots, warps * run, "warp", threads=warps * WARP_LANES)


# Kernel factories: ``pack_kernel(run, slots, warps)`` and so on (kernels/shells.py).
(pack_kernel, merge_kernel, merge_table_kernel, merge_keys_kernel, select_kernel,
 select_table_kernel, pack_to_peers_kernel, merge_delivered_kernel, merge_delivered_table_kernel,
 merge_delivered_keys_kernel, merge_table_addressed_kernel,
 pack_addressed_kernel) = kernel_factories(selection)
