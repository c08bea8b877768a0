"""Device side of the IPC all-gather (:class:`numba_cp.comm.ipc.IPCAllGather`).

Every rank owns one *exchange buffer*, mapped into every peer's address space
(CUDA/HIP IPC on a GPU; host shared memory under the simulator)::

    flags  int64[world + 1]   flags[q]: the last call rank q has fully delivered
                              here; flags[world]: poison (a rank that timed out)
    data   [2][world][slot]   data[e & 1][q]: rank q's payload of call e

and a private control word array ``ctrl`` (:data:`EPOCH`, :data:`COUNTER`,
:data:`ERR_EPOCH`, :data:`ERR_PEER`). One all-gather is three launches on the
caller's stream, none of which the host waits for or decides anything from:

1. :func:`ipc_bump_kernel` -- ``ctrl[EPOCH] += 1``. The epoch ``e`` lives on
   the device, so a captured graph replays the *same* kernels and still moves
   on to a new epoch each time (a host epoch argument would be frozen in it).
2. :func:`ipc_push_kernel` (one launch per :data:`GROUP` peers) -- writes
   ``send`` into ``data[e & 1][rank]`` of every peer, fences at system scope
   and, from the grid's last block, stores ``e`` into ``flags[rank]`` of every
   peer (release).
3. :func:`ipc_wait_copy_kernel` -- every block waits until each own
   ``flags[q] >= e`` (acquire), for at most ``timeout_ns`` of wall clock, then copies
   ``data[e & 1]`` into ``recv``.

Why two halves (double buffering by epoch parity) and ``>=`` and not a second
barrier: a rank only passes step 3 of call ``e`` once every peer has *started*
call ``e`` (its flag reached ``e``), and a peer starts call ``e`` only after
its own step 3 of call ``e - 1`` -- its copy-out of half ``(e - 1) & 1`` --
is done (stream order). So a fast rank that runs ahead into call ``e + 1``
writes half ``(e + 1) & 1``, which no peer reads any more (their call
``e - 1`` copy-outs are finished), and cannot reach call ``e + 2`` -- which
writes half ``e & 1`` again -- before every peer has started call ``e + 1``,
i.e. finished copying out call ``e``. A rank is therefore at most one call
ahead of the slowest, and two halves are exactly enough: no second "done"
barrier (a second round of flags and waits per call) is needed. A fast rank
can however move a slow peer's flag from ``e`` to ``e + 1`` before the slow
peer looked at it, hence the wait for ``flags[q] >= e`` (flags only grow, and
int64 never wraps) rather than ``== e``; the payload of call ``e`` in half
``e & 1`` is still intact then, as shown above.

Failure: a wait that has not seen every flag after ``timeout_ns`` of wall
clock (the GPU's global timer; ``NUMBA_CP_IPC_TIMEOUT`` seconds) gives up
instead of hanging: it records ``ERR_EPOCH`` (the call) and ``ERR_PEER``
(rank + 1 of the first missing peer) once, and stops waiting on every later
call. It also writes them to the rank's *error words*, host memory mapped into
the device, so the host sees the failure before its next call without a
synchronisation, and raises there. Its next push first stores ``rank + 1`` into every peer's
``flags[world]`` (poison, before any data of that call), since giving up
breaks the one-call-ahead bound and a later push may overwrite a half a slow
peer still reads; peers that see poison stop waiting too and record it in their own
error words, so no rank spins for long once one has given up, and every rank
that saw it refuses its next call. Data gathered from the failing call on is
garbage; :meth:`~numba_cp.comm.ipc.IPCAllGather.check` reads the full state
(a host synchronisation, outside the hot path).

Calls of one transport must be ordered (one stream, or the caller orders
the streams); :data:`COUNTER` and the epoch assume it.

The fused exchange (two kernels per exchange). The same protocol, moved into
the pack and merge kernels so that nothing runs between them and nothing is
copied out: the pack kernel (:func:`open_delivery`, :func:`deliver_key`,
:func:`close_delivery`) reads ``e = ctrl[EPOCH] + 1``, writes each ``(head,
row)``'s keys straight into slot ``rank`` of half ``e & 1`` of every rank's
buffer (its own included), in the send layout ``[heads, tokens, per_shard]``,
fences at system scope, and its grid's last block stores ``e`` into
``ctrl[EPOCH]`` and ``flags[rank]`` of every rank (release). The merge kernel
(:func:`await_delivery`) waits in every block, as step 3 does, for every
``flags[q] >= ctrl[EPOCH]`` and merges the keys where they landed,
``[(e & 1) * world + q]`` of its own buffer. So the epoch is still a device
value (a captured graph of the two kernels moves on each replay), the bump
launch is gone (the pack publishes the epoch it used), and so are the push
launches and the copy-out.

Where the merge waits. Waiting in every merge block is right when each rank
has a GPU of its own: the blocks that spin are this rank's, and the packs
they wait for run elsewhere. Ranks that share one GPU (under MPS) share its
block slots, and a waiting block holds its slot: with enough ranks, the
merges that wait fill the GPU and the pack they wait for cannot start (on
one H200, eight ranks' case-b merges timed out so). There, one thread of
:func:`ipc_wait_kernel` waits instead, between the pack and a merge that
reads in place without waiting: one block per rank, whatever the grid. The
transport picks the form from the ranks' GPUs (see
:class:`numba_cp.comm.ipc.IPCAllGather`); the protocol is the same.

Why every pack block reads the old epoch: thread 0 of each block reads
``ctrl[EPOCH]`` before its block adds itself to :data:`COUNTER`, and only the
block that finds every other block counted writes it. Why the halves still
suffice, now that a merge reads half ``e & 1`` for its whole run rather than
during a copy-out: a peer writes that half again only in its pack of call
``e + 2``, which it starts after its merge of call ``e + 1`` finished (stream
order); that merge needed this rank's flag of call ``e + 1``, raised by this
rank's pack of call ``e + 1``, which started after this rank's merge of call
``e`` finished. So a rank is still at most one call ahead, with the merge in
the place of the copy-out. The flags mean the same in both forms ("rank q has
delivered call e here"), and both forms address a payload the same way
(:func:`slot_base`, the send layout), so fused and separate calls may follow
each other on one transport. The failure path is the same too: a merge that
gives up records it in ``ctrl`` and the error words, and the next pack
poisons every peer before it writes a key.

Scope: the pack takes every peer's buffer as a kernel argument, up to
:data:`PEER_SLOTS` (one node's GPUs); larger worlds gather in separate steps, or
in two levels, whose node level is this protocol over the node's ranks: the pack
is addressed by its place in the node (``peer_rank``, ``npeers``), its shard
still by its global rank and world.

Memory ordering, per backend (the helpers live in :mod:`.primitives`, like every
per-target primitive; nothing here differs between targets):
``cuda`` polls with ``ld.acquire.sys`` and signals with ``st.release.sys``
(inline PTX, sm_70+), fences with ``membar.sys`` (``cuda.threadfence_system``),
naps with ``nanosleep`` while polling and reads ``%globaltimer`` for the
timeout; ``hip`` uses LLVM ``load atomic acquire`` / ``store atomic release``
/ ``fence seq_cst`` (LLVM's default scope is the whole system), ``s_sleep``
and ``s_memrealtime`` (100 MHz), as intrinsics, since numba-hip's
``cuda.atomic.*`` do not type on array elements; the simulator uses plain
NumPy loads and stores (each flag has a single writer) and sleeps briefly
while polling so that ranks sharing a CPU core make progress. The control
words' atomics (:func:`ctrl_add`, :func:`ctrl_cas`) are ``cuda.atomic.add`` /
``cas`` except on HIP (``atomicrmw`` / ``cmpxchg``).
"""

from __future__ import annotations


from numba import int64

from ..backend import cuda
from .params import WORD, Array, declare, scalars
from .primitives import (chain_grids, clock_ns, ctrl_add, ctrl_cas, fence_system, flag_load,
                         flag_store, spin_pause)

__all__ = [
    "EPOCH", "COUNTER", "ERR_EPOCH", "ERR_PEER", "CTRL_WORDS", "GROUP",
    "GAVE_UP_EPOCH", "GAVE_UP_PEER", "POISONED_BY", "ERROR_WORDS",
    "slot_base", "PEER_SLOTS", "delivery_base", "open_delivery", "deliver_key", "close_delivery",
    "await_delivery",
    "ipc_bump_kernel", "ipc_push_kernel", "ipc_wait_copy_kernel", "ipc_wait_kernel",
]

# ctrl (private to a rank) word indices
EPOCH = 0  # calls started so far; call e works with epoch e (first call: 1)
COUNTER = 1  # blocks of the current push launch that are done (last-block pattern)
ERR_EPOCH = 2  # the first call whose wait timed out (0: none)
ERR_PEER = 3  # 1 + the peer that call was still waiting for
CTRL_WORDS = 8

# error words (host-readable without a synchronisation: mapped host memory)
GAVE_UP_EPOCH = 0  # the call whose wait on this rank gave up (0: none)
GAVE_UP_PEER = 1  # 1 + the peer it was waiting for
POISONED_BY = 2  # 1 + a peer that gave up, as a wait on this rank saw it (0: none)
ERROR_WORDS = 4

GROUP = 8  # peers one push launch serves (kernel arguments d0..d7, f0..f7)
# Ranks a delivering pack kernel serves (kernel arguments peer0..peer7): one node's GPUs.
PEER_SLOTS = 8

# Parameters: 1-D C-contiguous views (what IPCEngine passes); payloads move in
# WORDs, 8-byte words when the buffers allow and bytes otherwise.
_WORDS = Array("words", "int64", 1, "C")
_CTRL = _WORDS._replace(name="ctrl")
BUMP_PARAMS = (_CTRL,)
PUSH_PARAMS = (_CTRL, Array("send", WORD, 1, "C"),
               *scalars("count", "slot", "world", "rank", "npeers"),
               *(Array(f"d{i}", WORD, 1, "C") for i in range(GROUP)),
               *(_WORDS._replace(name=f"f{i}") for i in range(GROUP)))
WAIT_COPY_PARAMS = (_CTRL, _WORDS._replace(name="flags"), Array("data", WORD, 1, "C"),
                    Array("recv", WORD, 1, "C"), _WORDS._replace(name="errors"),
                    *scalars("count", "slot", "world", "timeout_ns"))
WAIT_PARAMS = (_CTRL, _WORDS._replace(name="flags"), _WORDS._replace(name="errors"),
               *scalars("world", "timeout_ns"))


def slot_base(epoch, world, rank, slot):
    """Element offset of rank ``rank``'s payload of call ``epoch`` in a data area.

    Pure Python as well as a device function, so the protocol model in the
    tests addresses the halves exactly as the kernels do.
    """
    return ((epoch & 1) * world + rank) * slot


_slot_base = cuda.jit(device=True, inline=True)(slot_base)


# ---------------------------------------------------------------------------
# Kernels


@cuda.jit
@declare(*BUMP_PARAMS, chained=True)
def ipc_bump_kernel(ctrl):
    """``ctrl[EPOCH] += 1``: the next call's epoch (one thread)."""
    chain_grids()
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        ctrl[EPOCH] = ctrl[EPOCH] + 1


@cuda.jit(device=True, inline=True)
def _copy_slot(dst, src, base, start, step, count):
    i = start
    while i < count:
        dst[base + i] = src[i]
        i += step


@cuda.jit(device=True)
def _copy_to(p, d0, d1, d2, d3, d4, d5, d6, d7, src, base, start, step, count):
    if p == 0:
        _copy_slot(d0, src, base, start, step, count)
    elif p == 1:
        _copy_slot(d1, src, base, start, step, count)
    elif p == 2:
        _copy_slot(d2, src, base, start, step, count)
    elif p == 3:
        _copy_slot(d3, src, base, start, step, count)
    elif p == 4:
        _copy_slot(d4, src, base, start, step, count)
    elif p == 5:
        _copy_slot(d5, src, base, start, step, count)
    elif p == 6:
        _copy_slot(d6, src, base, start, step, count)
    elif p == 7:
        _copy_slot(d7, src, base, start, step, count)


@cuda.jit(device=True)
def _store_to(p, f0, f1, f2, f3, f4, f5, f6, f7, index, value):
    if p == 0:
        flag_store(f0, index, value)
    elif p == 1:
        flag_store(f1, index, value)
    elif p == 2:
        flag_store(f2, index, value)
    elif p == 3:
        flag_store(f3, index, value)
    elif p == 4:
        flag_store(f4, index, value)
    elif p == 5:
        flag_store(f5, index, value)
    elif p == 6:
        flag_store(f6, index, value)
    elif p == 7:
        flag_store(f7, index, value)


@cuda.jit
@declare(*PUSH_PARAMS, chained=True)
def ipc_push_kernel(ctrl, send, count, slot, world, rank, npeers,
                    d0, d1, d2, d3, d4, d5, d6, d7, f0, f1, f2, f3, f4, f5, f6, f7):
    """Deliver ``send`` (``count`` elements) to ``npeers <= GROUP`` peers.

    Grid ``(blocks, npeers)``: ``blockIdx.y`` picks the peer, whose data area
    is ``d<y>`` and flag area ``f<y>`` (unused ones may repeat any array).
    """
    chain_grids()
    tid = cuda.threadIdx.x
    p = cuda.blockIdx.y
    e = ctrl[EPOCH]
    if tid == 0 and ctrl[ERR_EPOCH] != 0:
        # This rank gave up waiting once: poison the peer before this call's data
        # can overwrite a half that a slow peer may still read.
        _store_to(p, f0, f1, f2, f3, f4, f5, f6, f7, world, int64(rank + 1))
        fence_system()
    cuda.syncthreads()
    base = _slot_base(e, world, rank, slot)
    _copy_to(p, d0, d1, d2, d3, d4, d5, d6, d7, send, base,
             cuda.blockIdx.x * cuda.blockDim.x + tid, cuda.gridDim.x * cuda.blockDim.x, count)
    fence_system()  # this thread's payload stores, visible system-wide ...
    cuda.syncthreads()  # ... for the whole block ...
    if tid == 0:
        blocks = cuda.gridDim.x * cuda.gridDim.y
        if ctrl_add(ctrl, COUNTER, int64(1)) == blocks - 1:
            # ... and, in the last block to finish, for the whole grid: signal.
            ctrl[COUNTER] = 0  # the next launch starts after this one (same stream)
            fence_system()
            for q in range(npeers):
                _store_to(q, f0, f1, f2, f3, f4, f5, f6, f7, rank, e)


@cuda.jit(device=True)
def _wait_all(ctrl, flags, errors, world, e, timeout_ns):
    """Poll until every ``flags[q] >= e``; give up after ``timeout_ns`` of wall clock.

    Giving up, or seeing a peer's poison, is written to ``errors`` (host-mapped),
    which the host reads before its next call without synchronising.
    """
    start = clock_ns()
    for q in range(world):
        while flag_load(flags, q) < e:
            if ctrl[ERR_EPOCH] != 0:
                return  # this rank gave up before: results are marked bad
            poison = flag_load(flags, world)
            if poison != 0:
                if errors[POISONED_BY] == 0:
                    flag_store(errors, POISONED_BY, poison)
                return  # a peer gave up: stop waiting too
            if clock_ns() - start > timeout_ns:
                if ctrl_cas(ctrl, ERR_EPOCH, int64(0), e) == 0:
                    ctrl[ERR_PEER] = q + 1
                    flag_store(errors, GAVE_UP_PEER, q + 1)
                    flag_store(errors, GAVE_UP_EPOCH, e)
                return
            spin_pause()


@cuda.jit
@declare(*WAIT_COPY_PARAMS, chained=True)
def ipc_wait_copy_kernel(ctrl, flags, data, recv, errors, count, slot, world, timeout_ns):
    """Wait for every peer's payload of this call, then ``data[e & 1] -> recv``."""
    chain_grids()
    tid = cuda.threadIdx.x
    e = ctrl[EPOCH]
    if tid == 0:
        _wait_all(ctrl, flags, errors, world, e, timeout_ns)
        fence_system()  # acquire for the whole block (with the barrier below)
    cuda.syncthreads()
    total = world * count
    i = cuda.blockIdx.x * cuda.blockDim.x + tid
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < total:
        q = i // count
        recv[i] = data[_slot_base(e, world, q, slot) + (i - q * count)]
        i += step


# ---------------------------------------------------------------------------
# The delivered exchange: the same protocol inside the pack and merge kernels.
# Peers are addressed as whole exchange buffers of int64 words (flags at word
# 0, the data halves from ``data_start``), so one array argument per rank.


@cuda.jit(device=True, inline=True)
def delivery_base(data_start, epoch, world, rank, slot, head, row, tokens, per_shard):
    """Word index of ``rank``'s key 0 of ``(head, row)`` in any rank's exchange buffer:
    the send layout ``[heads, tokens, per_shard]`` in the rank's slot of the half."""
    return data_start + _slot_base(epoch, world, rank, slot) + (head * tokens + row) * per_shard


@cuda.jit(device=True, inline=True)
def deliver_key(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, world, index, value):
    """``peer<q>[index] = value`` for every rank ``q < world``: one key into every
    rank's buffer (plain stores; :func:`close_delivery` publishes them)."""
    peer0[index] = value
    if world > 1:
        peer1[index] = value
    if world > 2:
        peer2[index] = value
    if world > 3:
        peer3[index] = value
    if world > 4:
        peer4[index] = value
    if world > 5:
        peer5[index] = value
    if world > 6:
        peer6[index] = value
    if world > 7:
        peer7[index] = value


@cuda.jit(device=True)
def _signal_each_peer(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, world, index,
                      value):
    """``flag_store(peer<q>, index, value)`` (release, system scope) for every rank ``q``."""
    flag_store(peer0, index, value)
    if world > 1:
        flag_store(peer1, index, value)
    if world > 2:
        flag_store(peer2, index, value)
    if world > 3:
        flag_store(peer3, index, value)
    if world > 4:
        flag_store(peer4, index, value)
    if world > 5:
        flag_store(peer5, index, value)
    if world > 6:
        flag_store(peer6, index, value)
    if world > 7:
        flag_store(peer7, index, value)


@cuda.jit(device=True)
def open_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, world, rank,
                  epoch_box):
    """This call's epoch, ``ctrl[EPOCH] + 1``, for every thread of the block.

    Thread 0 reads it (into the shared ``epoch_box``) before its block counts
    itself done in :func:`close_delivery`, so no block can read the epoch the
    last block publishes. A rank that gave up waiting once poisons every peer
    first, before any key of this call can overwrite a half a slow peer reads.
    """
    if cuda.threadIdx.x == 0:
        if ctrl[ERR_EPOCH] != 0:
            _signal_each_peer(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, world,
                              world, int64(rank + 1))
        epoch_box[0] = ctrl[EPOCH] + 1
    cuda.syncthreads()
    return epoch_box[0]


@cuda.jit(device=True)
def close_delivery(ctrl, peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, world, rank,
                   epoch):
    """After a block's keys are delivered; the grid's last block publishes the call.

    It stores the epoch into ``ctrl[EPOCH]`` (the merge that follows on the
    stream reads it) and raises this rank's flag in every peer (release).
    """
    fence_system()  # this thread's key stores, visible system-wide ...
    cuda.syncthreads()  # ... for the whole block ...
    if cuda.threadIdx.x == 0:
        blocks = cuda.gridDim.x * cuda.gridDim.y
        if ctrl_add(ctrl, COUNTER, int64(1)) == blocks - 1:
            # ... and, in the last block to finish, for the whole grid: signal.
            ctrl[COUNTER] = 0
            ctrl[EPOCH] = epoch
            fence_system()
            _signal_each_peer(peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7, world,
                              rank, epoch)


@cuda.jit(device=True)
def await_delivery(ctrl, flags, errors, world, timeout_ns, block_wait):
    """``first``, the index of rank 0's slot of this call's half in ``[2 * world]``;
    with ``block_wait``, after waiting until every rank delivered this call
    (thread 0 polls, bounded). Without it, :func:`ipc_wait_kernel` waited."""
    epoch = ctrl[EPOCH]
    if block_wait != 0:  # the same for the whole grid: a kernel argument
        if cuda.threadIdx.x == 0:
            _wait_all(ctrl, flags, errors, world, epoch, timeout_ns)
            fence_system()  # acquire for the whole block (with the barrier below)
        cuda.syncthreads()
    return (epoch & 1) * world


@cuda.jit
@declare(*WAIT_PARAMS, chained=True)
def ipc_wait_kernel(ctrl, flags, errors, world, timeout_ns):
    """One thread waits until every rank delivered this call; the merge after it on
    the stream reads in place without waiting (``block_wait=0``)."""
    chain_grids()
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        _wait_all(ctrl, flags, errors, world, ctrl[EPOCH], timeout_ns)
        fence_system()
