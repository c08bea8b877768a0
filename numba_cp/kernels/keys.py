"""Device functions for SPEC.md's packed int64 key and the row window.

Bit patterns are carried as int64 holding a uint32 value: mixing Numba's
uint32 with int64 promotes to float64, which would silently corrupt keys.
"""

import numpy as np
from numba import float32, int64

from ..backend import cuda
from ..constants import INIT_SCORE, KEY_VALID_BIT, LOCAL_SCORE, SPARSE_BLOCK
from .primitives import float_bits


def _ordered_host(score):
    bits = int(np.float32(score).view(np.uint32))
    return bits ^ 0xFFFFFFFF if bits & 0x80000000 else bits ^ 0x80000000


# Pinned scores are constants, so their ordered bits are too; the merge then
# needs no float bit casts at all.
ORDERED_INIT = _ordered_host(INIT_SCORE)
ORDERED_LOCAL = _ordered_host(LOCAL_SCORE)
ORDERED_POSITIVE_ZERO = _ordered_host(0.0)
ORDERED_NEGATIVE_ZERO = _ordered_host(-0.0)
ORDERED_POSITIVE_INF = _ordered_host(np.inf)
ORDERED_NEGATIVE_INF = _ordered_host(-np.inf)


# The two maps below are written as selects, not early returns: a branch per
# key costs the small-row kernels a reconvergence point each, a select nothing.


@cuda.jit(device=True, inline=True)
def ordered_from_bits(bits):
    """Order-preserving uint32 of a float32 bit pattern (-0 as +0, NaN lowest)."""
    magnitude = bits & 0x7FFFFFFF
    # negative: all bits flipped; positive: the sign bit set
    ordered = bits ^ (((bits >> 31) * 0x7FFFFFFF) | 0x80000000)
    ordered = int64(0x80000000) if magnitude == 0 else ordered
    return int64(0) if magnitude > 0x7F800000 else ordered


@cuda.jit(device=True, inline=True)
def pin_ordered(ordered, block, init_blocks, local_start):
    """Ordered score after pinning: local beats init beats the block's own."""
    ordered = int64(ORDERED_INIT) if block < init_blocks else ordered
    return int64(ORDERED_LOCAL) if block >= local_start else ordered


@cuda.jit(device=True, inline=True)
def make_key(ordered, block):
    return int64(KEY_VALID_BIT) | (ordered << 16) | (block + 1)


@cuda.jit(device=True, inline=True)
def score_key(score, block, init_blocks, local_start):
    """Key of a valid block from its raw float32 score."""
    ordered = ordered_from_bits(float_bits(score))
    return make_key(pin_ordered(ordered, block, init_blocks, local_start), block)


@cuda.jit(device=True, inline=True)
def canonical_ordered(ordered):
    """A gathered key's ordered score as ``ordered_from_bits`` would give it for the
    float it encodes (any uint32 ``ordered``): -0 becomes +0 and every NaN 0, all
    else stays."""
    ordered = int64(ORDERED_POSITIVE_ZERO) if ordered == ORDERED_NEGATIVE_ZERO else ordered
    nan = ordered > ORDERED_POSITIVE_INF or ordered < ORDERED_NEGATIVE_INF
    return int64(0) if nan else ordered


@cuda.jit(device=True, inline=True)
def repin_key(key, init_blocks, local_start):
    """A gathered non-zero key decoded, pinned with this row's window and repacked."""
    block = (key & 0xFFFF) - 1
    ordered = canonical_ordered((key >> 16) & 0xFFFFFFFF)
    return make_key(pin_ordered(ordered, block, init_blocks, local_start), block)


SPARSE_SHIFT = SPARSE_BLOCK.bit_length() - 1
assert 1 << SPARSE_SHIFT == SPARSE_BLOCK

# Context lengths past this select exactly as this does (every block valid and
# none of them local, since init/local_blocks < 2**31), and capping them keeps
# the arithmetic below from overflowing for any integer dtype of seq_lens.
CONTEXT_CAP = 1 << 40


@cuda.jit(device=True, inline=True)
def causal_len_of(seq_len, t, query_len):
    capped = int64(CONTEXT_CAP) if seq_len > CONTEXT_CAP else int64(seq_len)
    return capped - query_len + t + 1


@cuda.jit(device=True, inline=True)
def valid_blocks_of(causal_len):
    if causal_len <= 0:
        return int64(0)
    return (causal_len + (SPARSE_BLOCK - 1)) >> SPARSE_SHIFT


@cuda.jit(device=True, inline=True)
def quotient(x, d):
    """``x // d`` for ``x >= 0`` and ``d >= 1``.

    A shift when ``d`` is a power of two, as query_len and world usually are:
    an integer division is a ~20-instruction dependent chain on a GPU, and
    the small-row kernels run two of them before their first score load. The
    shift is read from the exponent of ``float32(d)``, exact for every power
    of two an int64 holds, on every target alike.
    """
    if d & (d - 1) == 0:
        return x >> ((float_bits(float32(d)) >> 23) - 127)
    return x // d
