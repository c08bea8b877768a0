"""Compile every kernel for a real GPU target without a GPU.

    NUMBA_CP_BACKEND=cuda NUMBA_CP_COMPILE_ONLY=1 python -m numba_cp.compile_check

builds PTX for sm_90 (``--cc`` picks others) through ``numba.cuda.compile_ptx``
and prints a table, one line per kernel specialisation. The simulator accepts
code that real targets reject (types, unsupported calls); this catches that.
Exit status 1 if any kernel fails.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from types import SimpleNamespace

from numba import types

from .backend import NAME, cuda

A = "A"  # any layout: the wrappers pass strided views
CAPACITIES = (16, 2048)  # the smallest sort tile the tests use and the envelope's largest


def _array(dtype, ndim):
    return types.Array(dtype, ndim, A)


def specialisations():
    """``(label, python function, signature)`` for every kernel the wrappers can launch."""
    from .kernels.topk import merge_sparse_table_kernel, merge_topk_kernel, shard_topk_kernel

    i64 = types.int64
    for capacity in CAPACITIES:
        for seq in (types.int32, types.int64):
            seq_lens = _array(seq, 1)
            yield (f"shard_topk_keys[cap={capacity},seq_lens={seq}]",
                   shard_topk_kernel(capacity).py_func,
                   (_array(types.float32, 3), seq_lens, _array(i64, 3)) + (i64,) * 7)
            merge_args = (_array(i64, 4), seq_lens, _array(types.int32, 3), i64, i64, i64)
            yield (f"merge_topk_ids[cap={capacity},seq_lens={seq}]",
                   merge_topk_kernel(capacity).py_func, merge_args)
            yield (f"merge_topk_ids_and_table[cap={capacity},seq_lens={seq}]",
                   merge_sparse_table_kernel(capacity).py_func,
                   merge_args + (_array(types.int32, 2), i64, _array(types.int32, 3),
                                 _array(types.int32, 2)))


@contextlib.contextmanager
def _target_device(cc):
    """Let device functions compile for ``cc`` with no GPU present.

    numba-cuda compiles a kernel's device functions for the *current* device's
    compute capability; with no device, supply the target's instead.
    """
    from numba.cuda import dispatcher

    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def compile_all(cc=(9, 0)):
    """Yield ``(label, ok, seconds, detail)`` per specialisation."""
    with _target_device(cc):
        yield from _compile_each(cc)


def _compile_each(cc):
    for label, pyfunc, signature in specialisations():
        start = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, types.void(*signature), cc=cc)
        except Exception as exc:  # report every kernel, not just the first failure
            yield label, False, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
        else:
            yield label, True, time.perf_counter() - start, f"{len(ptx)} bytes of PTX"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 or 8.0")
    args = parser.parse_args(argv)
    if NAME != "cuda":
        print(f"compile_check needs NUMBA_CP_BACKEND=cuda (with NUMBA_CP_COMPILE_ONLY=1 on a "
              f"machine with no GPU); the active backend is {NAME}", file=sys.stderr)
        return 2
    cc = tuple(int(part) for part in args.cc.split("."))
    failures = 0
    print(f"{'kernel':<52} {'sm':>4} {'result':<6} {'s':>6}  detail")
    for label, ok, seconds, detail in compile_all(cc):
        failures += not ok
        print(f"{label:<52} {cc[0]}{cc[1]:<3} {'ok' if ok else 'FAIL':<6} {seconds:6.2f}  {detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
