"""Where a host call's time goes: cProfile over many eager calls (case b shapes).

    NUMBA_CP_BACKEND=cuda python benchmarks/profile_call.py [--calls 2000]
"""

import argparse
import cProfile
import pstats
import time


import numpy as np

import numba_cp
from numba_cp import reference as ref
from numba_cp.arrays import device_copy
from numba_cp.workload import decode_workload


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    work = decode_workload(heads=4, batch=64, query_len=1, context=128 * 1024)
    kw = dict(query_len=1, init_blocks=1, local_blocks=2)
    shard = device_copy(ref.shard_scores(work.full_scores, rank=0, world=4,
                                         global_blocks=work.global_blocks))
    seq = device_copy(work.seq_lens)
    out = device_copy(np.zeros((4, 64, 16), np.int64))
    keys = device_copy(np.zeros((4, 4, 64, 16), np.int64))
    idx = device_copy(np.zeros((4, 64, 16), np.int32))

    def pack():
        numba_cp.local_topk_keys(shard, seq, topk=16, rank=0, world=4,
                                 global_blocks=work.global_blocks, out=out, **kw)

    def merge():
        numba_cp.merge_topk_keys(keys, idx, seq, **kw)

    for fn in (pack, merge):
        fn()
        numba_cp.backend.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        numba_cp.backend.cuda.synchronize()
        print(f"{fn.__name__}: {(time.perf_counter() - start) * 1e6 / args.calls:.1f} us/call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        pack()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
