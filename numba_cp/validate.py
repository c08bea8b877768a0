"""Argument checks shared by the host wrappers; every message names the argument."""

from __future__ import annotations

import numbers
import os

import numpy as np

from .arrays import KernelArray


def integer(name: str, value, *, low=None, high=None) -> int:
    """``value`` as an int in ``[low, high)`` (either bound optional)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value >= high):
        bound = (f"in [{low}, {high})" if low is not None and high is not None
                 else f">= {low}" if low is not None else f"< {high}")
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def env_switch(var: str, off: str, on: str) -> bool | None:
    """Environment variable ``var`` as a 0/1 switch (None: unset or empty). ``off`` and
    ``on`` say what 0 and 1 mean, in the ValueError any other value raises."""
    setting = os.environ.get(var, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{var} must be 0 ({off}) or 1 ({on}), got {setting!r}")
    return None if setting == "" else setting == "1"


def dtype(array: KernelArray, expected) -> None:
    if array.dtype != np.dtype(expected):
        raise TypeError(f"{array.name} must be {np.dtype(expected).name}, got {array.dtype.name}")


def integer_dtype(array: KernelArray) -> None:
    if array.dtype.kind not in "iu":
        raise TypeError(f"{array.name} must have an integer dtype, got {array.dtype.name}")


def ndim(array: KernelArray, *expected: int) -> None:
    if array.ndim not in expected:
        wanted = " or ".join(str(n) for n in expected)
        raise ValueError(f"{array.name} must be {wanted}-D, got shape {array.shape}")


def dim(array: KernelArray, axis: int, expected: int, what: str) -> None:
    if array.shape[axis] != expected:
        raise ValueError(f"{array.name}.shape[{axis}] must be {expected} ({what}), "
                         f"got shape {array.shape}")


def dim_at_least(array: KernelArray, axis: int, minimum: int, what: str) -> None:
    if array.shape[axis] < minimum:
        raise ValueError(f"{array.name}.shape[{axis}] must be >= {minimum} ({what}), "
                         f"got shape {array.shape}")


def rows(tokens: int, query_len: int, seq_lens: KernelArray) -> int:
    """Checks the row layout and returns the request count."""
    if tokens % query_len:
        raise ValueError(f"tokens ({tokens}) must be a multiple of query_len ({query_len})")
    requests = tokens // query_len
    ndim(seq_lens, 1)
    integer_dtype(seq_lens)
    dim_at_least(seq_lens, 0, requests, "one per request: tokens // query_len")
    return requests


def writable_output(array: KernelArray) -> None:
    """An output must be writable and must not alias itself (a zero stride)."""
    if array.readonly:
        raise ValueError(f"{array.name}: is read-only, but it is an output")
    if 0 in array.shape:
        return  # no elements, nothing to alias
    for axis, (n, stride) in enumerate(zip(array.shape, array.strides or ())):
        if n > 1 and stride == 0:
            raise ValueError(f"{array.name}: has stride 0 on axis {axis}, so its elements "
                             "alias each other, but it is an output")


class Footprint:
    """Where a call's arrays lie, to check that no output overlaps another array.

    Built once per signature from the arrays' extents; :meth:`check` runs per
    call on the data pointers (skipped when they repeat the last good call's).
    """

    def __init__(self, arrays, outputs):
        # arrays: KernelArray or None, in the wrapper's order; outputs: their names
        self.names = [a.name if a is not None else None for a in arrays]
        self.extents = [a.extent() if a is not None else None for a in arrays]
        self.outputs = [i for i, name in enumerate(self.names) if name in outputs]
        self._checked = None

    def check(self, objects, pointers):
        pointers = tuple(pointers) if pointers is not None else tuple(map(_address, objects))
        if pointers == self._checked:
            return
        spans = [None if e is None or p is None or e[0] == e[1] else (p + e[0], p + e[1])
                 for p, e in zip(pointers, self.extents)]
        for i in self.outputs:
            for j, other in enumerate(spans):
                if j == i or spans[i] is None or other is None:
                    continue
                if spans[i][0] < other[1] and other[0] < spans[i][1]:
                    raise ValueError(f"{self.names[i]}: overlaps {self.names[j]} in memory; "
                                     "an output must not share memory with another argument")
        self._checked = pointers


def _address(obj):
    if obj is None:
        return None
    if isinstance(obj, np.ndarray):
        return obj.__array_interface__["data"][0]
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return interface["data"][0]
    return None
