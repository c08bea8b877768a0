"""World 1 in one kernel, cases e, d and b, chained launches on, off and on again.

Per call: the graph-replay time (median of 5 graphs of 20 calls, 10 replays each), and
for 500 eager calls back to back on one CuPy stream the host time to queue them, the GPU
time between events recorded before and after them, and the wall time to the last
one's end (the best of 5 rounds by wall time).

    NUMBA_CP_BACKEND=cuda python results/h100-2026-12-08/chained_eager_probe.py

from the repository root.
"""
import statistics
import sys
import time

import cupy

sys.path.insert(0, "benchmarks")
from bench_kernels import CASES, INIT_BLOCKS, LOCAL_BLOCKS, device_us  # noqa
from numba_cp import launcher  # noqa
from numba_cp.ops import global_topk_ids  # noqa
from numba_cp.workload import decode_workload  # noqa

stream = cupy.cuda.Stream(non_blocking=True)
for name in ("e", "d", "b"):
    context, world, topk, batch, query_len, heads, table, *_ = CASES[name]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context, seed=0)
    kw = dict(query_len=query_len, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS,
              global_blocks=work.global_blocks)
    scores, seq = cupy.asarray(work.full_scores), cupy.asarray(work.seq_lens)
    idx = cupy.zeros((heads, work.tokens, topk), cupy.int32)
    print(f"case {name}: scores {scores.shape} strides {scores.strides}", flush=True)
    for chained in (True, False, True):
        launcher.set_chained_launches(chained)
        call = lambda s: global_topk_ids(scores, seq, idx, stream=s, **kw)  # noqa
        dev = statistics.median(device_us(call, stream, 20, 10) for _ in range(5))
        rows = []
        for _ in range(5):
            stream.synchronize()
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            t0 = time.perf_counter()
            for _ in range(500):
                global_topk_ids(scores, seq, idx, stream=stream, **kw)
            t1 = time.perf_counter()
            b.record(stream)
            b.synchronize()
            t2 = time.perf_counter()
            rows.append(((t1 - t0) * 2e3, cupy.cuda.get_elapsed_time(a, b) * 2, (t2 - t0) * 2e3))
            time.sleep(0.1)
        best = min(rows, key=lambda r: r[2])
        print(f"  chained={chained!s:<5} graph {dev:6.2f}  eager: enqueue {best[0]:6.2f}  "
              f"gpu {best[1]:6.2f}  wall {best[2]:6.2f}  (us/call, 500 calls, best of 5)",
              flush=True)
