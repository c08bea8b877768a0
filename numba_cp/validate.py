"""Argument checks shared by the host wrappers; every message names the argument."""

from __future__ import annotations

import numbers

import numpy as np

from .arrays import KernelArray


def integer(name: str, value, *, low=None, high=None) -> int:
    """``value`` as an int in ``[low, high)`` (either bound optional)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value >= high:
        raise ValueError(f"{name} must be < {high}, got {value}")
    return value


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
