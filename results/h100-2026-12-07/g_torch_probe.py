"""Why g's merge + table costs more with tensors in bench_kernels' rounds than in
profile_call: the same call under each difference between the two harnesses, in
interleaved rounds seconds apart; host us per call, min and median of the rounds.

    NUMBA_CP_BACKEND=cuda python results/h100-2026-12-07/g_torch_probe.py [CALLS]

from the repository root (it imports benchmarks/bench_kernels.py for case g's arrays).
"""
import statistics
import sys
import time

import cupy
import torch

import numba_cp
sys.path.insert(0, "benchmarks")
from bench_kernels import case_arrays  # noqa: E402

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
ROUNDS = 9
topk, window, _, g = case_arrays("g")
names = ("keys", "topk_idx", "seq_lens", "attention_block_table", "sparse_block_table_out",
         "sparse_context_lens_out")
cp = {k: g[k] for k in names}
shared = {k: torch.as_tensor(v, device="cuda") for k, v in cp.items()}
cloned = {k: torch.as_tensor(v, device="cuda").clone() for k, v in cp.items()}
stream = cupy.cuda.Stream(non_blocking=True)
side = torch.cuda.Stream()
cupy.cuda.Device().synchronize()
torch.cuda.synchronize()


def merge(a, **kw):
    numba_cp.merge_topk_keys(a["keys"], a["topk_idx"], a["seq_lens"], **window,
                             attention_block_table=a["attention_block_table"],
                             sparse_block_table_out=a["sparse_block_table_out"],
                             sparse_context_lens_out=a["sparse_context_lens_out"], **kw)


def on_side(a):
    with torch.cuda.stream(side):
        merge(a)


variants = {
    "cupy, no stream": (lambda: merge(cp), numba_cp.backend.cuda.synchronize),
    "cupy, stream": (lambda: merge(cp, stream=stream), stream.synchronize),
    "cupy, stream, method=auto": (lambda: merge(cp, stream=stream, method="auto"),
                                  stream.synchronize),
    "torch shared, no stream": (lambda: merge(shared), torch.cuda.synchronize),
    "torch shared, method=auto": (lambda: merge(shared, method="auto"),
                                  torch.cuda.synchronize),
    "torch cloned, no stream": (lambda: merge(cloned), torch.cuda.synchronize),
    "torch cloned, numba sync": (lambda: merge(cloned), numba_cp.backend.cuda.synchronize),
    "torch shared, cupy stream": (lambda: merge(shared, stream=stream), stream.synchronize),
    "torch shared, side stream": (lambda: on_side(shared), torch.cuda.synchronize),
}
for call, sync in variants.values():
    call()
    sync()
took = {k: [] for k in variants}
for _ in range(ROUNDS):
    for name, (call, sync) in variants.items():
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        sync()
        took[name].append((time.perf_counter() - start) * 1e6 / CALLS)
    time.sleep(0.3)
print(f"g merge + table, host us per call, {CALLS} calls a round, {ROUNDS} rounds "
      f"interleaved; torch current stream {torch.cuda.current_stream().cuda_stream}")
for name, t in took.items():
    print(f"{name:<30}{min(t):8.2f}{statistics.median(t):8.2f}")
