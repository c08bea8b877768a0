"""The few device primitives whose spelling differs between targets.

Everything else in :mod:`numba_cp.kernels` is plain Numba that all three
targets accept. Keep this module tiny: one function per primitive, one
definition per target, and a simulator fallback written in plain Python (the
simulator runs kernels as Python threads, so a Python function is a device
function there).

Atomics: numba-hip 0.2.1's ``hip.atomic.add`` / ``exch`` / ... are HIP C++'s
``atomicAdd(int*, int)`` and friends wrapped as scalar functions (the pointer
becomes a return value), so ``cuda.atomic.add(array, i, v)`` does not type on
HIP. There the atomics below are small intrinsics that emit LLVM ``atomicrmw``
on the element's address (relaxed ordering, as CUDA's ``atomicAdd`` is).
"""

import ctypes
import threading
import time
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import int32, int64, types, uint64

from .. import _numba
from ..backend import TARGET, cuda

NAME = TARGET.name
if NAME != "sim":
    intrinsic, cgutils = _numba.intrinsic_api(NAME)

__all__ = ["inline_device", "float_bits", "bits_as_float64", "shared_atomic_add",
           "WARP_LANES", "lane_exchange", "lane_read", "lanes_all", "lane_counts",
           "block_any", "flag_load", "flag_store", "fence_system", "spin_pause", "clock_ns",
           "ctrl_add", "ctrl_cas", "chain_grids", "as_array"]


def inline_device(fn):
    """A device function the GPU compiler must inline (LLVM ``alwaysinline``).

    For functions that take register arrays (``cuda.local.array``): a call
    that stays a call would put the array in local memory. Unlike Numba-IR
    inlining (``inline=True``), this does not re-type the callee in every
    caller, which kept a warp kernel's first compile at ~12 s. numba-hip has
    no such switch; its LLVM inliner takes such small functions anyway.
    """
    if NAME == "cuda":
        return cuda.jit(device=True, forceinline=True)(fn)
    return cuda.jit(device=True)(fn)


if NAME == "sim":

    def float_bits(x):
        """uint32 bit pattern of float32 ``x``, widened to int64."""
        return np.int64(np.float32(x).view(np.uint32))

elif NAME == "cuda":
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def float_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF

elif NAME == "hip":
    from numba import hip
    from numba.hip.amdgcn import ADDRSPACE_SHARED

    @cuda.jit(device=True, inline=True)
    def float_bits(x):
        # HIP's __float_as_uint, which numba-hip exposes as hip.float_as_uint
        return int64(hip.float_as_uint(x)) & 0xFFFFFFFF

    _ATOMIC_DTYPES = (types.int32, types.uint32, types.int64, types.uint64)

    @intrinsic
    def shared_atomic_add(typingctx, array, index, value):
        """``array[index] += value`` atomically on a shared (LDS) array; returns the old value.

        The element's generic address is cast to LDS, so the atomic is a ``ds_add``.
        """
        if not (isinstance(array, types.Array) and array.ndim == 1
                and array.dtype in _ATOMIC_DTYPES and isinstance(index, types.Integer)
                and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            array_type, index_type, value_type = sig.args
            array_value, index_value, value_value = args
            view = context.make_array(array_type)(context, builder, array_value)
            index_value = context.cast(builder, index_value, index_type, types.intp)
            pointer = cgutils.get_item_pointer(context, builder, array_type, view,
                                               [index_value], wraparound=False)
            element = context.get_value_type(array_type.dtype)
            pointer = builder.addrspacecast(pointer, ir.PointerType(element, ADDRSPACE_SHARED))
            value_value = context.cast(builder, value_value, value_type, array_type.dtype)
            return builder.atomic_rmw("add", pointer, value_value, "monotonic")

        return array.dtype(array, index, value), codegen

else:  # pragma: no cover - backend.py admits only the names above
    raise ImportError(f"no primitives for backend {NAME!r}")


# An int64 read as the float64 with its bits. A non-negative int64 whose bits
# 52-62 are not all set is a non-negative finite (or subnormal) float64, and
# such values order as floats exactly as they do as integers: the rank family
# compares its tagged keys so, in one float64 compare instead of two 32-bit
# integer compares. (FP64 keeps subnormals on NVIDIA and CDNA GPUs.)
if NAME == "sim":

    def bits_as_float64(x):
        return np.int64(x).view(np.float64)

else:

    @intrinsic
    def bits_as_float64(typingctx, x):
        if x != types.int64:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.DoubleType())

        return types.float64(x), codegen


if NAME != "hip":

    @cuda.jit(device=True, inline=True)
    def shared_atomic_add(array, index, value):
        """``array[index] += value`` atomically on a shared array; returns the old value."""
        return cuda.atomic.add(array, index, value)


# ---------------------------------------------------------------------------
# Lanes of a warp (a wavefront on AMD) trading registers: the warp-level top-k
# (numba_cp.kernels.warp). Callers keep control flow warp-uniform, with
# ``lane = threadIdx.x % WARP_LANES`` (1-D blocks of whole warps), and only
# ever read the partner ``lane ^ lane_mask``.
#
# The simulator has no shuffles; its warps are WARP_LANES consecutive Python
# threads meeting at a per-warp barrier (TARGET.lanes: 8 by default,
# NUMBA_CP_SIM_LANES picks others).


WARP_LANES = TARGET.lanes

if NAME == "sim":
    SIM_WARP_TIMEOUT_S = 120.0  # a lane that never arrives is a bug: fail, don't hang
    _MAILBOX_LOCK = threading.Lock()

    class _WarpMailbox:
        def __init__(self):
            self.values = [None] * WARP_LANES
            self.barrier = threading.Barrier(WARP_LANES, timeout=SIM_WARP_TIMEOUT_S)

    def _mailbox():
        warp, block_state = _numba.simulated_warp_slot(WARP_LANES)
        with _MAILBOX_LOCK:
            boxes = block_state.setdefault("_numba_cp_warps", {})
            box = boxes.get(warp)
            if box is None:
                box = boxes[warp] = _WarpMailbox()
        return box

    def lane_read(value, lane, source_lane):
        """Lane ``source_lane``'s ``value`` (every lane of the warp must call it)."""
        box = _mailbox()
        box.values[lane] = value
        box.barrier.wait()
        other = box.values[source_lane]
        box.barrier.wait()  # nobody posts the next value before every lane has read
        return other

    def lane_exchange(src, dst, count, lane, lane_mask):
        """``dst[s]`` = lane ``lane ^ lane_mask``'s ``src[s]`` for ``s < count``."""
        dst[:count] = lane_read(np.array(src[:count]), lane, lane ^ lane_mask)

    def _lane_value(value, lane, lane_mask):
        """Lane ``lane ^ lane_mask``'s int32 ``value`` (lane_counts' butterfly)."""
        return np.int32(lane_read(np.int32(value), lane, lane ^ lane_mask))

elif NAME == "cuda":
    FULL_MASK = 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def lane_exchange(src, dst, count, lane, lane_mask):
        for s in range(count):
            dst[s] = cuda.shfl_xor_sync(FULL_MASK, src[s], lane_mask)

    @cuda.jit(device=True, inline=True)
    def lane_read(value, lane, source_lane):
        return cuda.shfl_sync(FULL_MASK, value, source_lane)

elif NAME == "hip":
    # wave64 on gfx90a/gfx942 (CDNA). HIP's __shfl_xor is ds_bpermute underneath;
    # calling the LLVM intrinsic directly needs no HIP header stub and no width
    # clamp (lane ^ lane_mask < 64 always).

    @intrinsic
    def _ds_bpermute(typingctx, byte_address, value):
        if not (isinstance(byte_address, types.Integer) and value == types.int32):
            return None

        def codegen(context, builder, sig, args):
            word = ir.IntType(32)
            permute = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(word, [word, word]), "llvm.amdgcn.ds.bpermute")
            address = context.cast(builder, args[0], sig.args[0], types.int32)
            return builder.call(permute, [address, args[1]])

        return types.int32(byte_address, value), codegen

    @cuda.jit(device=True, inline=True)
    def _read_lane(value, source_lane):
        address = int32(source_lane << 2)
        low = _ds_bpermute(address, int32(value & 0xFFFFFFFF))
        high = _ds_bpermute(address, int32(value >> 32))
        return (int64(high) << 32) | (int64(low) & 0xFFFFFFFF)

    @cuda.jit(device=True, inline=True)
    def lane_exchange(src, dst, count, lane, lane_mask):
        for s in range(count):
            dst[s] = _read_lane(src[s], lane ^ lane_mask)

    @cuda.jit(device=True, inline=True)
    def lane_read(value, lane, source_lane):
        return _read_lane(int64(value), source_lane)

    # numba-hip has no warp votes: the wavefront's ballot (a 64-bit mask, one bit a
    # lane), the set bits of the lanes below this one (mbcnt, as HIP's
    # __lane_id does), and a population count, as LLVM intrinsics.
    @intrinsic
    def _ballot(typingctx, flag):
        if not isinstance(flag, types.Boolean):
            return None

        def codegen(context, builder, sig, args):
            ballot = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(64), [ir.IntType(1)]),
                "llvm.amdgcn.ballot.i64")
            return builder.call(ballot, [args[0]])

        return types.uint64(flag), codegen

    def _mask_to_int32(emit):
        """An intrinsic of a ballot's uint64 mask whose int32 value ``emit(builder,
        mask)`` builds."""

        @intrinsic
        def of_mask(typingctx, mask):
            if mask != types.uint64:
                return None

            def codegen(context, builder, sig, args):
                return emit(builder, args[0])

            return types.int32(mask), codegen

        return of_mask

    def _emit_set_bits_below(builder, mask):
        word = ir.IntType(32)
        kind = ir.FunctionType(word, [word, word])
        low = cgutils.get_or_insert_function(builder.module, kind, "llvm.amdgcn.mbcnt.lo")
        high = cgutils.get_or_insert_function(builder.module, kind, "llvm.amdgcn.mbcnt.hi")
        below_low = builder.call(low, [builder.trunc(mask, word), ir.Constant(word, 0)])
        upper = builder.trunc(builder.lshr(mask, ir.Constant(ir.IntType(64), 32)), word)
        return builder.call(high, [upper, below_low])

    def _emit_set_bits(builder, mask):
        wide = ir.IntType(64)
        ctpop = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(wide, [wide]), "llvm.ctpop.i64")
        return builder.trunc(builder.call(ctpop, [mask]), ir.IntType(32))

    _set_bits_below = _mask_to_int32(_emit_set_bits_below)
    _set_bits = _mask_to_int32(_emit_set_bits)


if NAME == "cuda":

    @cuda.jit(device=True, inline=True)
    def lanes_all(flag, lane):
        """Whether ``flag`` holds in every lane of the warp (one vote)."""
        return cuda.all_sync(FULL_MASK, flag)

elif NAME == "hip":

    @cuda.jit(device=True, inline=True)
    def lanes_all(flag, lane):
        """Whether ``flag`` holds in every lane of the wavefront (one ballot)."""
        return _ballot(not flag) == uint64(0)

else:  # the simulator has no warp votes: lane_counts' butterfly counts the lanes

    def lanes_all(flag, lane):
        """Whether ``flag`` holds in every lane of the warp."""
        return _count_lanes_one_bit(0 if flag else 1, False, lane)[1] == 0


@lru_cache(maxsize=None)
def lane_counts(bits):
    """``counts(count, flag, lane) -> (below, total, any_flag)``: ``count`` summed
    over the warp's lanes below ``lane`` and over all of them, and whether any
    lane's ``flag`` is set. Each lane's ``count`` is below ``2**bits`` and the
    warp's sum below ``2**16``.

    On CUDA one vote per bit of ``count`` and a population count: a lane's
    share of the sum is independent of the others'; on HIP the same with the
    wavefront's ballot and ``mbcnt`` (compiled for gfx90a and gfx942, not run on
    an AMD GPU here). In the simulator a butterfly of shuffles with the flags
    above bit 16 of the same word.
    """
    if NAME == "cuda":

        @cuda.jit(device=True, inline=True)
        def counts(count, flag, lane):
            lower = cuda.lanemask_lt()
            below = int32(0)
            total = int32(0)
            for b in range(bits):
                votes = cuda.ballot_sync(FULL_MASK, ((count >> b) & 1) != 0)
                below = int32(below + (int32(cuda.popc(votes & lower)) << b))
                total = int32(total + (int32(cuda.popc(votes)) << b))
            return below, total, cuda.any_sync(FULL_MASK, flag)

        return counts

    if NAME == "hip":

        @cuda.jit(device=True, inline=True)
        def counts(count, flag, lane):
            below = int32(0)
            total = int32(0)
            for b in range(bits):
                votes = _ballot(((count >> b) & 1) != 0)
                below = int32(below + (_set_bits_below(votes) << b))
                total = int32(total + (_set_bits(votes) << b))
            return below, total, _ballot(flag) != uint64(0)

        return counts

    @cuda.jit(device=True, inline=True)
    def counts(count, flag, lane):
        total = int32(count + ((int32(1) if flag else int32(0)) << 16))
        below = int32(0)
        mask = 1
        while mask < WARP_LANES:
            other = int32(_lane_value(total, lane, mask))
            if lane & mask:
                below = int32(below + other)
            total = int32(total + other)
            mask <<= 1
        return int32(below & 0xFFFF), int32(total & 0xFFFF), total > 0xFFFF

    return counts


if NAME == "sim":
    # lanes_all's counter, built at import and not on its first use: inside a simulated
    # kernel this module's `cuda` may be the simulator's stand-in, which it swaps in
    # around each device-function call, thread by thread, and which has no `jit`.
    _count_lanes_one_bit = lane_counts(1)


# A block barrier that also votes (the rank family's check that sorted runs are), spelt
# as a shared flag set before one barrier and read after it, on every target. Not
# Numba's syncthreads_or (llvm.nvvm.barrier0.or): on one NVIDIA H100 on 2026-12-07 every
# rank merge that voted with it and found its runs out of order never finished, and with
# this spelling the same launches and tests/test_merge.py were exact (BENCHMARKS.md,
# "Small rows, 2026-12-07: the rank merge's block vote"). Alone it cost g's merge + table
# 0.10 us there (1.91 against 1.81); with a presorted row laid out before the vote
# (kernels/rank.py) it reads 1.81 again, and a's and b's merges read the same. numba-hip
# has no block votes at all. compile_check fails a kernel whose PTX votes at a barrier.
@cuda.jit(device=True, inline=True)
def block_any(flag, cell):
    """A barrier that says whether ``flag`` held in any thread of the block.
    ``cell`` (a shared int64 array of one element) must read 0 and have settled at an
    earlier barrier."""
    if flag:
        cell[0] = 1
    cuda.syncthreads()
    return cell[0] != 0


# ---------------------------------------------------------------------------
# System-scope ordering for flags that other processes (and GPUs) poll: the IPC
# all-gather's signalling (numba_cp.kernels.ipc). Acquire loads and release
# stores at system scope, a system fence, a polite pause while spinning, and the
# control words' atomics.

if NAME in ("cuda", "hip"):  # both targets' intrinsics address an int64 word alike

    def _element_pointer(context, builder, array_type, array, index_type, index):
        index = context.cast(builder, index, index_type, types.intp)
        struct = context.make_array(array_type)(context, builder, value=array)
        return cgutils.get_item_pointer(context, builder, array_type, struct, [index],
                                        wraparound=False)

    def _is_word_array(array, index):
        return (isinstance(array, types.Array) and array.ndim == 1
                and array.dtype == types.int64 and isinstance(index, types.Integer))


if NAME == "sim":

    def flag_load(flags, index):
        """``flags[index]`` as seen by the whole system (acquire)."""
        return np.int64(flags[index])

    def flag_store(flags, index, value):
        """``flags[index] = value`` visible to the whole system (release)."""
        flags[index] = value

    def fence_system():
        pass  # the simulator's stores are plain NumPy stores: already in order

    def spin_pause():
        time.sleep(2e-4)  # let ranks sharing a core run; a simulated poll is slow anyway

    def clock_ns():
        """A wall clock in nanoseconds (for timeouts; any origin)."""
        return np.int64(time.monotonic_ns())

elif NAME == "cuda":

    @intrinsic
    def _ld_acquire_sys(typingctx, array, index):
        if not _is_word_array(array, index):
            return None
        signature = types.int64(array, index)

        def codegen(context, builder, sig, args):
            pointer = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                    args[1])
            word = ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(word, [word.as_pointer()]),
                               "ld.acquire.sys.b64 $0, [$1];", "=l,l,~{memory}",
                               side_effect=True)
            return builder.call(asm, [pointer])

        return signature, codegen

    @intrinsic
    def _st_release_sys(typingctx, array, index, value):
        if not _is_word_array(array, index) or not isinstance(value, types.Integer):
            return None
        signature = types.void(array, index, value)

        def codegen(context, builder, sig, args):
            pointer = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                    args[1])
            stored = context.cast(builder, args[2], sig.args[2], types.int64)
            word = ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [word.as_pointer(), word]),
                               "st.release.sys.b64 [$0], $1;", "l,l,~{memory}",
                               side_effect=True)
            builder.call(asm, [pointer, stored])
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def _globaltimer(typingctx):
        def codegen(context, builder, sig, args):
            word = ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(word, []), "mov.u64 $0, %globaltimer;", "=l",
                               side_effect=True)
            return builder.call(asm, [])

        return types.int64(), codegen

    @cuda.jit(device=True, inline=True)
    def clock_ns():
        return _globaltimer()  # the GPU's global nanosecond timer

    @cuda.jit(device=True, inline=True)
    def flag_load(flags, index):
        return _ld_acquire_sys(flags, index)

    @cuda.jit(device=True, inline=True)
    def flag_store(flags, index, value):
        _st_release_sys(flags, index, value)

    @cuda.jit(device=True, inline=True)
    def fence_system():
        cuda.threadfence_system()

    @cuda.jit(device=True, inline=True)
    def spin_pause():
        cuda.nanosleep(64)

elif NAME == "hip":
    # numba-hip 0.2.1's cuda.atomic.* are HIP C++'s scalar atomicAdd(...) wrappers and do
    # not type on array elements (see numba_cp.kernels.primitives), so everything here is
    # a small LLVM intrinsic. LLVM's default synchronisation scope is the whole system,
    # which is what AMDGPU needs for peers on other GPUs (xGMI) and in other processes.

    @intrinsic
    def _load_acquire(typingctx, array, index):
        if not _is_word_array(array, index):
            return None

        def codegen(context, builder, sig, args):
            pointer = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                       args[1])
            return builder.load_atomic(pointer, "acquire", 8)

        return types.int64(array, index), codegen

    @intrinsic
    def _store_release(typingctx, array, index, value):
        if not _is_word_array(array, index) or not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            pointer = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                       args[1])
            stored = context.cast(builder, args[2], sig.args[2], types.int64)
            builder.store_atomic(stored, pointer, "release", 8)
            return context.get_dummy_value()

        return types.void(array, index, value), codegen

    @intrinsic
    def _add(typingctx, array, index, value):
        if not _is_word_array(array, index) or not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            pointer = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                       args[1])
            value = context.cast(builder, args[2], sig.args[2], types.int64)
            return builder.atomic_rmw("add", pointer, value, "monotonic")

        return types.int64(array, index, value), codegen

    @intrinsic
    def _cas(typingctx, array, index, old, value):
        if not (_is_word_array(array, index) and isinstance(old, types.Integer)
                and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            pointer = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                       args[1])
            old = context.cast(builder, args[2], sig.args[2], types.int64)
            value = context.cast(builder, args[3], sig.args[3], types.int64)
            pair = builder.cmpxchg(pointer, old, value, "monotonic", "monotonic")
            return builder.extract_value(pair, 0)

        return types.int64(array, index, old, value), codegen

    @intrinsic
    def _fence_seq_cst(typingctx):
        def codegen(context, builder, sig, args):
            builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def _s_sleep(typingctx):
        def codegen(context, builder, sig, args):
            sleep = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]),
                "llvm.amdgcn.s.sleep")
            builder.call(sleep, [ir.Constant(ir.IntType(32), 1)])  # ~64 clocks
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def _memrealtime(typingctx):
        def codegen(context, builder, sig, args):
            word = ir.IntType(64)
            read = cgutils.get_or_insert_function(builder.module, ir.FunctionType(word, []),
                                                  "llvm.amdgcn.s.memrealtime")
            return builder.call(read, [])

        return types.int64(), codegen

    # s_memrealtime counts a constant 100 MHz clock on CDNA (gfx90a, gfx942).
    REALTIME_NS_PER_TICK = 10

    @cuda.jit(device=True, inline=True)
    def clock_ns():
        return _memrealtime() * REALTIME_NS_PER_TICK

    @cuda.jit(device=True, inline=True)
    def flag_load(flags, index):
        return _load_acquire(flags, index)

    @cuda.jit(device=True, inline=True)
    def flag_store(flags, index, value):
        _store_release(flags, index, value)

    @cuda.jit(device=True, inline=True)
    def fence_system():
        _fence_seq_cst()

    @cuda.jit(device=True, inline=True)
    def spin_pause():
        _s_sleep()

else:  # pragma: no cover - backend.py admits only the names above
    raise ImportError(f"no IPC primitives for backend {NAME!r}")


if NAME == "hip":

    @cuda.jit(device=True, inline=True)
    def ctrl_add(ctrl, index, value):
        """``ctrl[index] += value`` atomically (this GPU only); returns the old value."""
        return _add(ctrl, index, value)

    @cuda.jit(device=True, inline=True)
    def ctrl_cas(ctrl, index, old, value):
        """``ctrl[index] = value`` if it holds ``old``, atomically; returns what it held."""
        return _cas(ctrl, index, old, value)

else:

    @cuda.jit(device=True, inline=True)
    def ctrl_add(ctrl, index, value):
        """``ctrl[index] += value`` atomically (this GPU only); returns the old value."""
        return cuda.atomic.add(ctrl, index, value)

    @cuda.jit(device=True, inline=True)
    def ctrl_cas(ctrl, index, old, value):
        """``ctrl[index] = value`` if it holds ``old``, atomically; returns what it held."""
        return cuda.atomic.cas(ctrl, index, old, value)


# Programmatic dependent launch (NVIDIA sm_90 and newer): a kernel launched with
# the host's chained launch (numba_cp.launcher) may be launched before the grid ahead
# of it on the stream has finished. ``chain_grids()`` opens every such kernel: it waits
# until that grid has finished and its writes are visible (a no-op after an ordinary
# launch). Nothing may touch global memory before it. On older GPUs, AMD GPUs and the
# simulator it is nothing.
# It does not trigger the next launch (``griddepcontrol.launch_dependents``): the next
# chained kernel launches as this grid's blocks exit. With the trigger right after the
# wait, the next grid was placed while this one ran, and on one H100 (BENCHMARKS.md,
# "Chained launches without an early trigger") 500 eager world-1 calls back to back took
# 29.2 us of GPU time each in case e (18.8 us a kernel in a graph) and 19.6-21.0 in case
# d (14.3), against 19.0 and 14.6 without it; in graphs the two differed by at most 0.2 us.
if NAME == "cuda":
    from numba.cuda.cudadrv import nvvm as _nvvm

    _CHAINED_ARCH = 900  # griddepcontrol: PTX ISA 7.8, sm_90

    @intrinsic
    def chain_grids(typingctx):
        def codegen(context, builder, sig, args):
            # __nvvm_reflect("__CUDA_ARCH") is the architecture being compiled for, a
            # constant that libNVVM folds: older architectures never see the PTX.
            module = builder.module
            text = cgutils.make_bytearray(b"__CUDA_ARCH\0")
            name = cgutils.add_global_variable(module, text.type, name="numba_cp_cuda_arch",
                                               addrspace=_nvvm.ADDRSPACE_CONSTANT)
            name.linkage = "internal"
            name.global_constant = True
            name.initializer = text
            byte_pointer = ir.PointerType(ir.IntType(8))
            reflect = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.IntType(32), [byte_pointer]), "__nvvm_reflect")
            arch = builder.call(reflect, [builder.addrspacecast(name, byte_pointer)])
            chained = builder.icmp_signed(">=", arch, ir.Constant(ir.IntType(32), _CHAINED_ARCH))
            with builder.if_then(chained):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                                   "griddepcontrol.wait;",
                                   "~{memory}", side_effect=True)
                builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

elif NAME == "hip":

    @cuda.jit(device=True, inline=True)
    def chain_grids():
        pass

else:

    def chain_grids():
        pass


# An array parameter's value as an array. An ``Array`` parameter (kernels/params.py)
# is Numba's array struct already; an ``Address`` one is ``(address, *shape)``, all
# int64, and stands for the C-contiguous ``dtype`` array there. A kernel with several
# arrays then reads a parameter block a third the size, so that its first
# instructions wait on fewer constant-cache lines (g's merge + table: 25 words instead
# of 64). One kernel body serves both declarations.
if NAME == "sim":
    from numba.np.numpy_support import as_dtype

    def as_array(param, dtype):
        """``param`` itself, or the C-contiguous ``dtype`` array at ``(address, *shape)``."""
        if not isinstance(param, tuple):
            return param
        address, shape = int(param[0]), tuple(int(n) for n in param[1:])
        element = as_dtype(dtype)
        count = int(np.prod(shape))
        if count == 0:
            return np.empty(shape, element)
        memory = (ctypes.c_byte * (count * element.itemsize)).from_address(address)
        return np.frombuffer(memory, element).reshape(shape)

else:

    @intrinsic
    def as_array(typingctx, param, dtype):
        if not isinstance(dtype, types.NumberClass):
            return None
        if isinstance(param, types.Array):
            return param(param, dtype), lambda context, builder, sig, args: args[0]
        if not (isinstance(param, types.UniTuple) and param.dtype == types.int64
                and param.count >= 2):
            return None
        element = dtype.instance_type
        ndim = param.count - 1
        array_type = types.Array(element, ndim, "C")

        def codegen(context, builder, sig, args):
            address, *shape = cgutils.unpack_tuple(builder, args[0], param.count)
            intp = context.get_value_type(types.intp)
            itemsize = context.get_abi_sizeof(context.get_data_type(element))
            strides, stride = [], ir.Constant(intp, itemsize)
            for extent in reversed(shape):
                strides.insert(0, stride)
                stride = builder.mul(stride, extent)
            view = context.make_array(array_type)(context, builder)
            view.data = builder.inttoptr(address, view.data.type)
            view.shape = cgutils.pack_array(builder, shape, intp)
            view.strides = cgutils.pack_array(builder, strides, intp)
            view.itemsize = ir.Constant(intp, itemsize)
            view.nitems = stride  # the product of the extents
            view.meminfo = ir.Constant(view.meminfo.type, None)
            view.parent = ir.Constant(view.parent.type, None)
            return view._getvalue()

        return array_type(param, dtype), codegen
