"""Kernel parameters, declared once beside each kernel.

A launched kernel's parameters are its wrapper's arrays, in the wrapper's
order, then its scalars (all int64). :func:`declare` attaches the declaration to the
kernel's Python function and checks it against the argument names, so the
launcher (:mod:`numba_cp.launcher`) builds argument lists and the compile
check (:mod:`numba_cp.compile_check`) builds Numba signatures from the same
tuple, and neither can drift from the kernel.

An :class:`Address` is an array the kernel receives as its data address and
shape alone, all int64, and views with ``as_array`` (kernels/primitives.py):
C-contiguous arrays only, in a parameter block a third the size of Numba's
array structs (meminfo, parent, size, itemsize, data, shape, strides).

Array dtypes are NumPy names, or a placeholder that the compile check
specialises: :data:`INTEGER` (any integer dtype the wrapper accepts, such as
``seq_lens``) and :data:`WORD` (the IPC payload's word: bytes or int64).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Array", "Address", "Scalar", "INTEGER", "WORD", "by_address", "declare",
           "scalars"]

INTEGER = "integer"
WORD = "word"


class Array(NamedTuple):
    name: str
    dtype: str
    ndim: int
    layout: str = "A"  # any strides: the wrappers pass strided views


class Address(Array):
    """A C-contiguous array passed as ``(data address, *shape)``: ``ndim + 1`` int64
    words. Its wrapper launches it only with C-contiguous arrays."""


def by_address(params):
    """``params`` with every array an :class:`Address` (an :data:`INTEGER` one int32)."""
    return tuple(Address(p.name, "int32" if p.dtype == INTEGER else p.dtype, p.ndim, "C")
                 if isinstance(p, Array) else p for p in params)


class Scalar(NamedTuple):
    name: str  # every kernel scalar is an int64


def scalars(*names: str) -> tuple[Scalar, ...]:
    return tuple(Scalar(name) for name in names)


def declare(*params, chained=False):
    """Attach ``params`` to a kernel's Python function (apply below ``cuda.jit``).

    ``chained``: the kernel opens with ``chain_grids()`` (kernels/primitives.py),
    so the launcher may start it before the kernel ahead of it has finished.
    """

    def attach(fn):
        code = fn.__code__
        names = code.co_varnames[:code.co_argcount]
        declared = tuple(p.name for p in params)
        if names != declared:
            raise TypeError(f"{fn.__name__}: parameters {names} but declared {declared}")
        fn.params = tuple(params)
        fn.chained = chained
        return fn

    return attach
