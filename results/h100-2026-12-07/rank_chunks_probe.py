"""a's pack and world-1 kernel, and b's pack, with chunks of 64 and of 32: device us,
median of 7 graph timings (50 calls a graph, 20 replays).

    NUMBA_CP_BACKEND=cuda python results/h100-2026-12-07/rank_chunks_probe.py

from the repository root."""
import statistics
import sys

import cupy

import numba_cp
from numba_cp.ops import global_topk_ids
sys.path.insert(0, "benchmarks")
from bench_kernels import CASES, case_arrays, device_us  # noqa: E402
from numba_cp.workload import decode_workload  # noqa: E402

stream = cupy.cuda.Stream(non_blocking=True)
for name in ("a", "b"):
    topk, window, shard_args, x = case_arrays(name)
    context, world, topk, batch, query_len, heads, *_ = CASES[name]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context, seed=0)
    full = cupy.asarray(work.full_scores)
    idx = cupy.zeros((heads, work.tokens, topk), cupy.int32)
    for chunk in (64, 32, 64, 32):
        def pack(s):
            numba_cp.local_topk_keys(x["scores"], x["seq_lens"], topk=topk, rank=0,
                                     out=x["out"], stream=s, method="rank", sort_limit=chunk,
                                     **shard_args)

        def w1(s):
            global_topk_ids(full, x["seq_lens"], idx, global_blocks=work.global_blocks,
                                     stream=s, method="rank", sort_limit=chunk, **window)
        p = statistics.median(device_us(pack, stream, 50, 20) for _ in range(7))
        line = f"{name} chunk {chunk}: pack {p:.3f}"
        if work.global_blocks <= 256:
            line += f", world 1 {statistics.median(device_us(w1, stream, 50, 20) for _ in range(7)):.3f}"
        print(line, flush=True)
