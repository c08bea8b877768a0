"""Device functions for SPEC.md's packed int64 key and the row window.

Bit patterns are carried as int64 holding a uint32 value: mixing Numba's
uint32 with int64 promotes to float64, which would silently corrupt keys.
"""

import numpy as np
from numba import int64

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


@cuda.jit(device=True, inline=True)
def ordered_from_bits(bits):
    """Order-preserving uint32 of a float32 bit pattern (-0 as +0, NaN lowest)."""
    if bits == 0x80000000:
        bits = 0
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return int64(0)
    if bits & 0x80000000:
        return bits ^ 0xFFFFFFFF
    return bits ^ 0x80000000


@cuda.jit(device=True, inline=True)
def bits_from_ordered(ordered):
    if ordered & 0x80000000:
        return ordered ^ 0x80000000
    return ordered ^ 0xFFFFFFFF


@cuda.jit(device=True, inline=True)
def pin_ordered(ordered, block, init_blocks, local_start):
    """Ordered score after pinning: local beats init beats the block's own."""
    if block >= local_start:
        return int64(ORDERED_LOCAL)
    if block < init_blocks:
        return int64(ORDERED_INIT)
    return ordered


@cuda.jit(device=True, inline=True)
def make_key(ordered, block):
    return int64(KEY_VALID_BIT) | (ordered << 16) | (block + 1)


@cuda.jit(device=True, inline=True)
def score_key(score, block, init_blocks, local_start):
    """Key of a valid block from its raw float32 score."""
    ordered = ordered_from_bits(float_bits(score))
    return make_key(pin_ordered(ordered, block, init_blocks, local_start), block)


@cuda.jit(device=True, inline=True)
def repin_key(key, init_blocks, local_start):
    """A gathered non-zero key decoded, pinned with this row's window and repacked."""
    block = (key & 0xFFFF) - 1
    ordered = ordered_from_bits(bits_from_ordered((key >> 16) & 0xFFFFFFFF))
    return make_key(pin_ordered(ordered, block, init_blocks, local_start), block)


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
    return (causal_len + (SPARSE_BLOCK - 1)) // SPARSE_BLOCK
