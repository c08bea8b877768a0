"""Two device primitives whose CUDA spelling differs from the simulator's.

``float64_above(x, bound)`` is, on CUDA, the sign bit of ``bound - x``: the test
checks that claim in IEEE float64 arithmetic (NumPy's, subnormals kept, as on the
GPUs) for the values the rank kernels feed it, tagged keys read as float64, and
checks the active backend's function against ``x > bound``.

``lane_counts(bits)`` is, on CUDA, votes and population counts, elsewhere a
butterfly of shuffles; a one-warp kernel checks either against a NumPy prefix sum.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_cp.backend import TARGET, cuda
from numba_cp.constants import KEY_VALID_BIT
from numba_cp.kernels.keys import ORDERED_POSITIVE_INF
from numba_cp.kernels.primitives import (WARP_LANES, bits_as_float64, float64_above,
                                         lane_counts)
from numba_cp.kernels.rank import TAG_BITS

# What the rank kernels compare: a packed key (SPEC.md: 0 for no block, else the valid
# bit, the ordered score, at most +inf's, and block + 1) shifted up by TAG_BITS, with
# a tag below it.
TAG_TOP = (1 << TAG_BITS) - 1


def _tagged(key, tag):
    return (key << TAG_BITS) | tag


def _key(ordered, block_slot):
    return KEY_VALID_BIT | (ordered << 16) | block_slot


EDGES = [_tagged(0, 0), _tagged(0, 1), _tagged(0, TAG_TOP),
         _tagged(_key(0, 1), 0), _tagged(_key(0, 1), TAG_TOP),
         _tagged(_key(ORDERED_POSITIVE_INF, 0xFFFF), TAG_TOP),
         _tagged(_key(ORDERED_POSITIVE_INF, 0xFFFF), TAG_TOP - 1),
         _tagged(_key(ORDERED_POSITIVE_INF - 1, 0xFFFF), TAG_TOP)]
keys = st.one_of(st.just(0), st.builds(_key, st.integers(0, ORDERED_POSITIVE_INF),
                                       st.integers(1, 0xFFFF)))
tagged = st.one_of(st.sampled_from(EDGES), st.builds(_tagged, keys, st.integers(0, TAG_TOP)))

def _as_float64(value):
    return np.array([value], np.int64).view(np.float64)[0]


def test_edges_read_as_finite_float64():
    values = np.array(EDGES, np.int64).view(np.float64)
    assert np.isfinite(values).all() and (values >= 0).all()


@given(x=tagged, bound=tagged)
def test_subtraction_sign_orders_tagged_keys_as_integers(x, bound):
    with np.errstate(all="raise"):  # an overflow or invalid result would fail here
        difference = _as_float64(bound) - _as_float64(x)
    sign = int(np.array([difference]).view(np.uint64)[0] >> np.uint64(63))
    assert sign == int(x > bound)


@pytest.mark.skipif(not TARGET.simulator, reason="calls the device function from Python")
@given(x=tagged, bound=tagged)
def test_float64_above_is_the_integer_order(x, bound):
    assert float64_above(bits_as_float64(np.int64(x)), bits_as_float64(np.int64(bound))) \
        == int(x > bound)


def _counts_kernel(bits):
    counts = lane_counts(bits)

    @cuda.jit
    def lane_counts_of(count, flag, below, total, any_flag):
        lane = cuda.threadIdx.x
        b, t, a = counts(count[lane], flag[lane] != 0, lane)
        below[lane] = b
        total[lane] = t
        any_flag[lane] = 1 if a else 0

    return lane_counts_of


def _device(array):
    if TARGET.simulator:
        return array
    import cupy

    return cupy.asarray(array)


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()


@pytest.mark.parametrize("bits", [1, 3, 5])
@pytest.mark.parametrize("flags", ["none", "one", "many"])
def test_lane_counts_are_a_prefix_sum(bits, flags):
    rng = np.random.default_rng(bits * 7 + len(flags))
    count = rng.integers(0, 1 << bits, WARP_LANES).astype(np.int64)
    count[rng.integers(0, WARP_LANES)] = (1 << bits) - 1  # every bit in use somewhere
    flag = np.zeros(WARP_LANES, np.int64)
    if flags == "one":
        flag[WARP_LANES - 1] = 1
    elif flags == "many":
        flag[rng.integers(0, WARP_LANES, 3)] = 1
    outputs = [_device(np.full(WARP_LANES, -7, np.int64)) for _ in range(3)]
    _counts_kernel(bits)[1, WARP_LANES](_device(count), _device(flag), *outputs)
    below, total, any_flag = map(_host, outputs)
    np.testing.assert_array_equal(below, np.cumsum(count) - count)
    np.testing.assert_array_equal(total, np.full(WARP_LANES, count.sum()))
    np.testing.assert_array_equal(any_flag, np.full(WARP_LANES, int(flag.any())))
