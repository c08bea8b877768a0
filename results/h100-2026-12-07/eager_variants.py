"""Host µs of eager merges, g and b, called several ways in one process (run from the
repository root with NUMBA_CP_BACKEND=cuda): no stream, a CuPy stream, method given,
PyTorch tensors; 200 and 2000 calls a round, best of 3, and 2000 with the garbage
collector off; once with ops.ADDRESSED_DEFAULT off and once on."""
import gc
import sys
import time

import cupy
import torch

import numba_cp
import numba_cp.ops as ops

sys.path.insert(0, "benchmarks")
from bench_kernels import case_arrays, device_us  # noqa: E402

TABLES = ("attention_block_table", "sparse_block_table_out", "sparse_context_lens_out")


def host(call, calls, rounds, sync):
    call()
    sync()
    best = 1e9
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        best = min(best, (time.perf_counter() - t) * 1e6 / calls)
    return best


for addressed in (False, True):
    ops.ADDRESSED_DEFAULT = addressed
    for case in ("g", "b"):
        topk, window, shard_args, a = case_arrays(case)
        tables = {k: a[k] for k in TABLES if k in a}
        s = cupy.cuda.Stream(non_blocking=True)
        t = {k: torch.as_tensor(v, device="cuda") for k, v in a.items()}
        tt = {k: t[k] for k in tables}
        merge = numba_cp.merge_topk_keys

        def m_plain():
            merge(a["keys"], a["topk_idx"], a["seq_lens"], **window, **tables)

        def m_stream():
            merge(a["keys"], a["topk_idx"], a["seq_lens"], stream=s, **window, **tables)

        def m_method():
            merge(a["keys"], a["topk_idx"], a["seq_lens"], stream=s, **window, **tables,
                  method="auto")

        def m_torch():
            merge(t["keys"], t["topk_idx"], t["seq_lens"], **window, **tt)

        def m_torch_m():
            merge(t["keys"], t["topk_idx"], t["seq_lens"], **window, **tt, method="auto")

        sync = numba_cp.backend.cuda.synchronize
        rows = []
        for label, fn, sy in (("plain", m_plain, sync), ("stream", m_stream, s.synchronize),
                              ("stream+method", m_method, s.synchronize),
                              ("torch", m_torch, torch.cuda.synchronize),
                              ("torch+method", m_torch_m, torch.cuda.synchronize)):
            r = [host(fn, 200, 3, sy), host(fn, 2000, 3, sy)]
            gc.disable()
            r.append(host(fn, 2000, 3, sy))
            gc.enable()
            rows.append((label, r))
        with s:  # after a graph capture on s, as bench_kernels.py does
            device_us(lambda st: m_method(), s, 50, 20)
        rows.append(("stream+method after capture",
                     [host(m_method, 200, 3, s.synchronize),
                      host(m_method, 2000, 3, s.synchronize)]))
        with s:
            rows.append(("same inside `with s`", [host(m_method, 200, 3, s.synchronize),
                                                  host(m_method, 2000, 3, s.synchronize)]))
        print(f"case {case} merge, addressed default {addressed}: host us per call "
              "(200 calls best of 3, 2000 best of 3, 2000 gc off)")
        for label, r in rows:
            print(f"  {label:<30}" + "".join(f"{x:8.1f}" for x in r))
