"""The kernels every family builds, from the family's row selection.

A family (:mod:`.warp`, :mod:`.rank`) decides how a block selects its row's
top keys; its :class:`Selection` says how, and the builders here wrap it in
the kernels the host wrappers launch: where the candidates come from and
where the results go is the same for every family.

One block per ``(head, row)``. The row's top keys end in the threads'
registers, each key ``acc[s]`` with its place ``v[s]`` in the row's order,
and each thread writes its own (see :class:`Selection`). The
"delivered" kernels are the fused IPC exchange's (protocol: kernels/ipc.py):
the pack writes every rank's exchange buffer, the merge waits for its peers
and reads its own buffer.

Every kernel allocates its own local and shared arrays and hands them down:
numba-hip cannot return a local array from a device function.
"""

from functools import lru_cache
from typing import Callable, NamedTuple

from numba import float32, int32, int64, uint64

from ..backend import TARGET, cuda
from .ipc import await_delivery, close_delivery, deliver_key, delivery_base, open_delivery
from .params import declare
from .primitives import WARP_LANES, as_array, chain_grids, inline_device
from .rows import (MERGE_DELIVERED_KEYS_PARAMS, MERGE_DELIVERED_PARAMS,
                   MERGE_DELIVERED_TABLE_PARAMS, MERGE_KEYS_PARAMS,
                   MERGE_PARAMS, MERGE_TABLE_ADDRESSED_PARAMS, MERGE_TABLE_PARAMS,
                   PACK_ADDRESSED_PARAMS, PACK_PARAMS, PACK_TO_PEERS_PARAMS,
                   SELECT_PARAMS, SELECT_TABLE_PARAMS, gathered_key_of, gathered_load,
                   gathered_place, gathered_row, merged_block, shard_key_of, shard_load,
                   shard_place, shard_row, table_writer, whole_row, page_of,
                   request_seq_len, row_request)

__all__ = ["Selection", "KERNELS", "SMALL_ROW_KERNELS", "kernel_factories"]


class Selection(NamedTuple):
    """How a family selects a row's top keys, for one launch shape.

    ``make(load, key_of, presorted=False, warp_layout=False)`` returns
    ``(prefetch, select_top)`` with the convention of
    :func:`numba_cp.kernels.warp.make_warp_topk`. Afterwards each thread
    holds ``slots`` entries: key ``acc[s]`` at place ``v[s]`` of the row's
    descending order, places ``>= run`` being no entry; every place below
    ``run`` is held once. With ``warp_layout`` they are in warp 0, lane
    ``lane`` holding places ``lane * slots + s`` (the sparse-table writer's
    layout). ``slots`` sizes the local arrays (``raw``, ``v``, ``t``, ``acc``)
    and ``shared_size`` the shared int64 array; ``family`` ends the kernels'
    names.

    ``candidate``: ``None``, or a device function ``candidate(s)``, the row
    index of the thread's slot ``s`` of ``raw``, for a family whose
    ``warp_layout`` carries each candidate's ``t[s]`` along with its key: the
    table kernels then read every candidate's page while the row is selected.
    ``threads``: the block every kernel of this shape is launched with.
    """

    make: Callable
    slots: int
    shared_size: int
    family: str
    candidate: Callable = None
    threads: int = 0


# CUDA is told each kernel's block size (launch bounds), so that it never gives a
# thread more registers than a block of that size can hold: a 1024-thread block
# would otherwise fail to launch as soon as a kernel needs over 64 registers.
if TARGET.name == "cuda":

    def _kernel_options(sel):
        return {"launch_bounds": sel.threads} if sel.threads else {}

else:  # the simulator takes no launch bounds, and numba-hip is not given any

    def _kernel_options(sel):
        return {}


def _jit(fn, sel):
    """``fn`` compiled as a kernel named for its family (profiles and compile
    checks tell the families apart by name)."""
    fn.__name__ = fn.__qualname__ = f"{fn.__name__}_{sel.family}"
    return cuda.jit(**_kernel_options(sel))(fn)


@lru_cache(maxsize=None)
def _shard_select(sel):
    prefetch, select_top = sel.make(shard_load, shard_key_of)

    @inline_device
    def shard_select(scores, seq_lens, rank, world, query_len, global_blocks, init_blocks,
                     local_blocks, raw, v, t, acc, shared):
        """Select this block's (head, row): its keys ``acc`` at places ``v``."""
        request = row_request(query_len)
        prefetch(scores, shard_place(rank, world), scores.shape[2], raw)
        request_len = request_seq_len(seq_lens, request)
        head, row, count, ctx = shard_row(scores, request_len, rank, world, query_len,
                                          global_blocks, init_blocks, local_blocks)
        select_top(scores, ctx, count, raw, v, t, acc, shared)
        return head, row

    return shard_select


@lru_cache(maxsize=None)
def pack_kernel(sel):
    return _pack_kernel(sel, PACK_PARAMS, "shard_topk_keys")


@lru_cache(maxsize=None)
def pack_addressed_kernel(sel):
    """:func:`pack_kernel` over C-contiguous arrays given by address and shape."""
    return _pack_kernel(sel, PACK_ADDRESSED_PARAMS, "shard_topk_keys_addressed")


def _pack_kernel(sel, params, name):
    shard_select = _shard_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*params, chained=True)
    def shard_topk_keys(scores, seq_lens, out, topk, rank, world, query_len,
                        global_blocks, init_blocks, local_blocks):
        chain_grids()
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        keys = as_array(out, int64)
        head, row = shard_select(as_array(scores, float32), as_array(seq_lens, int32), rank,
                                 world, query_len, global_blocks, init_blocks, local_blocks,
                                 raw, v, t, acc, shared)
        for s in range(slots):
            if v[s] < topk:
                keys[uint64(head), uint64(row), uint64(v[s])] = acc[s]

    shard_topk_keys.__name__ = name
    return _jit(shard_topk_keys, sel)


@lru_cache(maxsize=None)
def pack_to_peers_kernel(sel):
    shard_select = _shard_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*PACK_TO_PEERS_PARAMS, chained=True)
    def shard_topk_keys_to_peers(scores, seq_lens, ctrl, peer0, peer1, peer2, peer3,
                                 peer4, peer5, peer6, peer7, topk, rank, world, query_len,
                                 global_blocks, init_blocks, local_blocks, data_start,
                                 slot, peer_rank, npeers):
        chain_grids()
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
        base = delivery_base(data_start, epoch, npeers, peer_rank, slot, head, row,
                             scores.shape[1], topk)
        for s in range(slots):
            if v[s] < topk:
                deliver_key(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, npeers,
                            base + v[s], acc[s])
        close_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, npeers,
                       peer_rank, epoch)

    return _jit(shard_topk_keys_to_peers, sel)


@lru_cache(maxsize=None)
def _ids_writer(slots):
    @inline_device
    def write_ids(acc, places, topk_idx, head, row, valid_blocks):
        """The thread's keys ``acc`` at ``places`` -> block ids (or -1), into
        ``topk_idx`` and back into ``acc``."""
        topk = topk_idx.shape[2]
        kept = min(topk, valid_blocks)
        for s in range(slots):
            e = places[s]
            block = merged_block(acc[s], e, kept)
            acc[s] = block
            if e < topk:
                topk_idx[uint64(head), uint64(row), uint64(e)] = block

    return write_ids


@lru_cache(maxsize=None)
def _merge_select(sel):
    prefetch, select_top = sel.make(gathered_load, gathered_key_of, presorted=True)
    write_ids = _ids_writer(sel.slots)

    @inline_device
    def merge_select(keys, first, world, topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, raw, v, t, acc, shared):
        """Merge this block's (head, row) from ``keys[first:first + world]``: write
        topk_idx and keep the ids (or -1) in ``acc``, at places ``v``."""
        prefetch(keys, gathered_place(keys, first), world * keys.shape[3], raw)
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, request, causal_len, valid_blocks, count, ctx = gathered_row(
            keys, first, world, request_len, query_len, init_blocks, local_blocks)
        select_top(keys, ctx, count, raw, v, t, acc, shared)
        write_ids(acc, v, topk_idx, head, row, valid_blocks)
        return head, row, request, causal_len

    return merge_select


@lru_cache(maxsize=None)
def _whole_row_select(sel):
    prefetch, select_top = sel.make(shard_load, shard_key_of)
    write_ids = _ids_writer(sel.slots)

    @inline_device
    def whole_row_select(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks,
                         local_blocks, raw, v, t, acc, shared):
        """World 1: this block's (head, row) top-k of pinned keys straight from the
        scores: write topk_idx and keep the ids (or -1) in ``acc``, at places ``v``."""
        request = row_request(query_len)
        prefetch(scores, shard_place(0, 1), scores.shape[2], raw)
        request_len = request_seq_len(seq_lens, request)
        head, row, request, causal_len, valid_blocks, count, ctx = whole_row(
            scores, request_len, query_len, global_blocks, init_blocks, local_blocks)
        select_top(scores, ctx, count, raw, v, t, acc, shared)
        write_ids(acc, v, topk_idx, head, row, valid_blocks)
        return head, row, request, causal_len

    return whole_row_select


@lru_cache(maxsize=None)
def select_kernel(sel):
    """World 1 in one kernel: the scores' global top-k block ids."""
    select = _whole_row_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*SELECT_PARAMS, chained=True)
    def global_topk_ids(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks,
                        local_blocks):
        chain_grids()
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        select(scores, seq_lens, topk_idx, query_len, global_blocks, init_blocks, local_blocks,
               raw, v, t, acc, shared)

    return _jit(global_topk_ids, sel)


@lru_cache(maxsize=None)
def select_table_kernel(sel):
    """World 1 in one kernel: the global top-k block ids and the sparse table."""
    prefetch, select_top = sel.make(shard_load, shard_key_of, warp_layout=True)
    write_ids = _ids_writer(sel.slots)
    candidate = sel.candidate
    early_pages = candidate is not None
    write_table = table_writer(sel.slots, preloaded=early_pages)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*SELECT_TABLE_PARAMS, chained=True)
    def global_topk_ids_and_table(scores, seq_lens, topk_idx, block_table, sparse_table,
                                  context_lens, query_len, global_blocks, init_blocks,
                                  local_blocks, page_stride):
        chain_grids()
        raw = cuda.local.array(slots, float32)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        request = row_request(query_len)
        prefetch(scores, shard_place(0, 1), scores.shape[2], raw)
        request_len = request_seq_len(seq_lens, request)
        if early_pages:  # world 1: candidate i is block i, so its page needs no score
            for s in range(slots):
                t[s] = page_of(candidate(s), request, block_table, page_stride)
        head, row, request, causal_len, valid_blocks, count, ctx = whole_row(
            scores, request_len, query_len, global_blocks, init_blocks, local_blocks)
        select_top(scores, ctx, count, raw, v, t, acc, shared)
        write_ids(acc, v, topk_idx, head, row, valid_blocks)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            write_table(acc, t, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens, lane)

    return _jit(global_topk_ids_and_table, sel)


@lru_cache(maxsize=None)
def _merge_with_table(sel):
    prefetch, select_top = sel.make(gathered_load, gathered_key_of, presorted=True,
                                    warp_layout=True)
    write_ids = _ids_writer(sel.slots)
    candidate = sel.candidate
    early_pages = candidate is not None
    write_table = table_writer(sel.slots, preloaded=early_pages)
    slots = sel.slots

    @inline_device
    def merge_with_table(keys, first, world, topk_idx, seq_lens, block_table, sparse_table,
                         context_lens, query_len, init_blocks, local_blocks, page_stride, raw, v,
                         t, acc, shared):
        prefetch(keys, gathered_place(keys, first), world * keys.shape[3], raw)
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, request, causal_len, valid_blocks, count, ctx = gathered_row(
            keys, first, world, request_len, query_len, init_blocks, local_blocks)
        if early_pages:  # every candidate's page, in flight while the row is selected
            for s in range(slots):
                t[s] = int64(0)
                if candidate(s) < count:
                    t[s] = page_of((raw[s] & 0xFFFF) - 1, request, block_table, page_stride)
        select_top(keys, ctx, count, raw, v, t, acc, shared)
        write_ids(acc, v, topk_idx, head, row, valid_blocks)
        lane = cuda.threadIdx.x
        if lane < WARP_LANES:
            write_table(acc, t, topk_idx.shape[2], causal_len, request, head, row, block_table,
                        page_stride, sparse_table, context_lens, lane)

    return merge_with_table


@lru_cache(maxsize=None)
def merge_kernel(sel):
    merge_select = _merge_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*MERGE_PARAMS, chained=True)
    def merge_topk_ids(keys, topk_idx, seq_lens, query_len, init_blocks, local_blocks):
        chain_grids()
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_select(keys, 0, keys.shape[0], topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, raw, v, t, acc, shared)

    return _jit(merge_topk_ids, sel)


@lru_cache(maxsize=None)
def merge_table_kernel(sel):
    return _merge_table_kernel(sel, MERGE_TABLE_PARAMS, "merge_topk_ids_and_table")


@lru_cache(maxsize=None)
def merge_table_addressed_kernel(sel):
    """:func:`merge_table_kernel` over C-contiguous arrays given by address and shape."""
    return _merge_table_kernel(sel, MERGE_TABLE_ADDRESSED_PARAMS,
                               "merge_topk_ids_and_table_addressed")


def _merge_table_kernel(sel, params, name):
    merge_with_table = _merge_with_table(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*params, chained=True)
    def merge_topk_ids_and_table(keys, topk_idx, seq_lens, block_table, sparse_table,
                                 context_lens, query_len, init_blocks, local_blocks,
                                 page_stride):
        chain_grids()
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        gathered = as_array(keys, int64)
        merge_with_table(gathered, 0, gathered.shape[0], as_array(topk_idx, int32),
                         as_array(seq_lens, int32), as_array(block_table, int32),
                         as_array(sparse_table, int32), as_array(context_lens, int32),
                         query_len, init_blocks, local_blocks, page_stride, raw, v, t, acc,
                         shared)

    merge_topk_ids_and_table.__name__ = name
    return _jit(merge_topk_ids_and_table, sel)


@lru_cache(maxsize=None)
def _merge_keys_select(sel):
    slots = sel.slots
    prefetch, select_top = sel.make(gathered_load, gathered_key_of, presorted=True)

    @inline_device
    def merge_keys_select(keys, first, world, out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, raw, v, t, acc, shared):
        """Merge this block's (head, row) from ``keys[first:first + world]``: write
        the top ``topk`` keys into ``out``."""
        prefetch(keys, gathered_place(keys, first), world * keys.shape[3], raw)
        request_len = request_seq_len(seq_lens, row_request(query_len))
        head, row, _, _, _, count, ctx = gathered_row(keys, first, world, request_len,
                                                      query_len, init_blocks, local_blocks)
        select_top(keys, ctx, count, raw, v, t, acc, shared)
        for s in range(slots):
            if v[s] < topk:
                out[uint64(head), uint64(row), uint64(v[s])] = acc[s]

    return merge_keys_select


@lru_cache(maxsize=None)
def merge_keys_kernel(sel):
    """The two-level exchange's first merge: gathered keys -> the top ``topk`` keys."""
    merge_keys_select = _merge_keys_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*MERGE_KEYS_PARAMS, chained=True)
    def merge_topk_keys_to_keys(keys, out, seq_lens, topk, query_len, init_blocks,
                                local_blocks):
        chain_grids()
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_keys_select(keys, 0, keys.shape[0], out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, raw, v, t, acc, shared)

    return _jit(merge_topk_keys_to_keys, sel)


@lru_cache(maxsize=None)
def merge_delivered_keys_kernel(sel):
    """The fused node level's merge: wait, then the delivered keys -> the top ``topk`` keys."""
    merge_keys_select = _merge_keys_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*MERGE_DELIVERED_KEYS_PARAMS, chained=True)
    def merge_delivered_topk_keys(keys, out, seq_lens, ctrl, flags, errors, topk,
                                  query_len, init_blocks, local_blocks, timeout_ns,
                                  block_wait):
        chain_grids()
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_keys_select(keys, first, world, out, seq_lens, topk, query_len, init_blocks,
                          local_blocks, raw, v, t, acc, shared)

    return _jit(merge_delivered_topk_keys, sel)


@lru_cache(maxsize=None)
def merge_delivered_kernel(sel):
    merge_select = _merge_select(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*MERGE_DELIVERED_PARAMS, chained=True)
    def merge_delivered_topk_ids(keys, topk_idx, seq_lens, ctrl, flags, errors,
                                 query_len, init_blocks, local_blocks, timeout_ns,
                                 block_wait):
        chain_grids()
        world = keys.shape[0] >> 1
        first = await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait)
        raw = cuda.local.array(slots, int64)
        v = cuda.local.array(slots, int64)
        t = cuda.local.array(slots, int64)
        acc = cuda.local.array(slots, int64)
        shared = cuda.shared.array(shared_size, int64)
        merge_select(keys, first, world, topk_idx, seq_lens, query_len, init_blocks,
                     local_blocks, raw, v, t, acc, shared)

    return _jit(merge_delivered_topk_ids, sel)


@lru_cache(maxsize=None)
def merge_delivered_table_kernel(sel):
    merge_with_table = _merge_with_table(sel)
    shared_size = sel.shared_size
    slots = sel.slots

    @declare(*MERGE_DELIVERED_TABLE_PARAMS, chained=True)
    def merge_delivered_topk_ids_and_table(keys, topk_idx, seq_lens, ctrl, flags, errors,
                                           block_table, sparse_table, context_lens,
                                           query_len, init_blocks, local_blocks,
                                           page_stride, timeout_ns, block_wait):
        chain_grids()
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

    return _jit(merge_delivered_topk_ids_and_table, sel)


# What a family module exports, in this order (numba_cp.ops and the compile
# checks look kernels up by these names).
KERNELS = ("pack_kernel", "merge_kernel", "merge_table_kernel", "merge_keys_kernel",
           "select_kernel", "select_table_kernel", "pack_to_peers_kernel",
           "merge_delivered_kernel", "merge_delivered_table_kernel",
           "merge_delivered_keys_kernel")
# Built by the small-row families only (warp, rank), after KERNELS: the kernels over
# arrays by address. The radix family's rows are long, so its parameter block is no
# part of its time; compiled for gfx942
# (tools/rocm_compile_check.sh, 2026-12-07) an addressed radix merge + table at sort
# tile 2048 spilled 249 VGPRs where the array one spills 62.
SMALL_ROW_KERNELS = ("merge_table_addressed_kernel", "pack_addressed_kernel")


def kernel_factories(selection):
    """The kernel factories of a family whose ``selection(*shape)`` gives its
    :class:`Selection`: ``factory(*shape)`` -> kernel, in the order of
    :data:`KERNELS` then :data:`SMALL_ROW_KERNELS`."""
    builders = [globals()[name] for name in KERNELS + SMALL_ROW_KERNELS]
    return tuple((lambda build: lambda *shape: build(selection(*shape)))(build)
                 for build in builders)
