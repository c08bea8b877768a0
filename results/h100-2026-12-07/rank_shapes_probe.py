"""Two questions on one GPU.

1. b's pack by launch shape: device us (graph replay, median of 7) with the rank
   kernels at chunks of 64 (the default when it ran) and 32, and 128 threads a row.
2. d's and e's world-1 calls, which take longer on the GPU than on the host: eager us
   per call (200 back to back, then one synchronisation; best and median of 7 rounds)
   by input and stream, against the kernel's graph-replay time.

    NUMBA_CP_BACKEND=cuda python results/h100-2026-12-07/rank_shapes_probe.py [shapes]

from the repository root; "shapes" runs the first part only.
"""
import statistics
import sys
import time

import cupy
import numpy as np
import torch

import numba_cp
sys.path.insert(0, "benchmarks")
from bench_kernels import CASES, INIT_BLOCKS, LOCAL_BLOCKS, case_arrays, device_us  # noqa
from numba_cp.ops import global_topk_ids  # noqa: E402
from numba_cp.workload import decode_workload  # noqa: E402

stream = cupy.cuda.Stream(non_blocking=True)
print("b pack by shape, device us, median of 7 (50 calls a graph, 20 replays)", flush=True)
topk, window, shard_args, b = case_arrays("b")
want = None
for label, kw in (("rank, default", {}), ("rank, chunk 32", dict(sort_limit=32)),
                  ("rank, 128 threads", dict(threads=128)),
                  ("rank, default again", {})):
    def pack(s, kw=kw):
        numba_cp.local_topk_keys(b["scores"], b["seq_lens"], topk=topk, rank=0, out=b["out"],
                                 stream=s, method="rank" if kw else "auto", **shard_args,
                                 **kw)
    times = [device_us(pack, stream, 50, 20) for _ in range(7)]
    got = cupy.asnumpy(b["out"])
    want = got if want is None else want
    print(f"{label:<30}{statistics.median(times):8.3f}{min(times):8.3f}"
          f"  same={np.array_equal(got, want)}", flush=True)

if "shapes" in sys.argv[1:]:
    sys.exit(0)
print("\nworld-1 eager us per call (200 calls, then one sync), best / median of 7 rounds")
for name in ("d", "e", "b"):
    context, world, topk, batch, query_len, heads, table, *_ = CASES[name]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context,
                           seed=0)
    kw = dict(query_len=query_len, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS,
              global_blocks=work.global_blocks)
    cp = dict(scores=cupy.asarray(work.full_scores), seq=cupy.asarray(work.seq_lens),
              idx=cupy.zeros((heads, work.tokens, topk), cupy.int32))
    tt = {k: torch.as_tensor(v, device="cuda") for k, v in cp.items()}
    side = torch.cuda.Stream()
    tstream = torch.cuda.Stream()

    def call(a, **s):
        global_topk_ids(a["scores"], a["seq"], a["idx"], **kw, **s)

    def in_torch_stream(a):
        with torch.cuda.stream(side):
            call(a)

    def torch_block_alone():
        with torch.cuda.stream(side):
            pass

    variants = {
        "cupy, non-blocking stream": (lambda: call(cp, stream=stream), stream.synchronize),
        "cupy, null stream": (lambda: call(cp), cupy.cuda.Device().synchronize),
        "cupy, torch's stream object": (lambda: call(cp, stream=tstream),
                                        torch.cuda.synchronize),
        "torch, no stream (current)": (lambda: call(tt), torch.cuda.synchronize),
        "torch, non-blocking stream": (lambda: call(tt, stream=stream), stream.synchronize),
        "torch, in torch.cuda.stream": (lambda: in_torch_stream(tt), torch.cuda.synchronize),
        "torch, stream=that stream": (lambda: call(tt, stream=side), torch.cuda.synchronize),
        "the torch.cuda.stream block alone": (torch_block_alone, torch.cuda.synchronize),
    }
    dev = device_us(lambda s: call(cp, stream=s), stream, 20, 10)
    for f, sync in variants.values():
        f()
        sync()
    took = {k: [] for k in variants}
    for _ in range(7):
        for label, (f, sync) in variants.items():
            start = time.perf_counter()
            for _ in range(200):
                f()
            sync()
            took[label].append((time.perf_counter() - start) * 1e6 / 200)
        time.sleep(0.2)
    print(f"case {name}: kernel {dev:.2f} us by graph replay")
    for label, t in took.items():
        print(f"  {label:<30}{min(t):8.2f}{statistics.median(t):8.2f}", flush=True)
