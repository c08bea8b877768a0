"""``lane_counts(bits)``, a device primitive whose CUDA spelling differs from the
simulator's: on CUDA votes and population counts, elsewhere a butterfly of shuffles.
A one-warp kernel checks the active backend's against a NumPy prefix sum, and
``lanes_all``, built on it in the simulator, against NumPy.
"""

import numpy as np
import pytest

from numba_cp.backend import cuda
from numba_cp.kernels.primitives import WARP_LANES, lane_counts
from support import to_device, to_host


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
    outputs = [to_device(np.full(WARP_LANES, -7, np.int64)) for _ in range(3)]
    _counts_kernel(bits)[1, WARP_LANES](to_device(count), to_device(flag), *outputs)
    below, total, any_flag = map(to_host, outputs)
    np.testing.assert_array_equal(below, np.cumsum(count) - count)
    np.testing.assert_array_equal(total, np.full(WARP_LANES, count.sum()))
    np.testing.assert_array_equal(any_flag, np.full(WARP_LANES, int(flag.any())))


def _all_lanes_kernel():
    from numba_cp.kernels.primitives import lanes_all

    @cuda.jit
    def every_lane_set(flag, out):
        lane = cuda.threadIdx.x
        out[lane] = 1 if lanes_all(flag[lane] != 0, lane) else 0

    return every_lane_set


@pytest.mark.parametrize("unset", [None, 0, WARP_LANES - 1])
def test_lanes_all_builds_nothing_inside_a_kernel(monkeypatch, unset):
    """``lanes_all`` against NumPy, with ``lane_counts`` unable to build anything while
    the kernel runs: in the simulator a device function built on first use inside a
    kernel met the simulator's stand-in for ``cuda``, which has no ``jit``, whenever
    another thread had it swapped in."""
    from numba_cp.kernels import primitives

    kernel = _all_lanes_kernel()

    def no_building(bits):
        raise AssertionError(f"lane_counts({bits}) built inside a kernel")

    monkeypatch.setattr(primitives, "lane_counts", no_building)
    flag = np.ones(WARP_LANES, np.int64)
    if unset is not None:
        flag[unset] = 0
    out = to_device(np.full(WARP_LANES, -7, np.int64))
    kernel[1, WARP_LANES](to_device(flag), out)
    np.testing.assert_array_equal(to_host(out), np.full(WARP_LANES, int(unset is None)))
