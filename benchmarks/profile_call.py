"""Where a host call's time goes: cProfile over many eager calls (case b shapes).

    NUMBA_CP_BACKEND=cuda python benchmarks/profile_call.py [--calls 2000]
    NUMBA_CP_BACKEND=cuda mpiexec -n 2 python benchmarks/profile_call.py --exchange

The first times the two public kernels' wrappers; ``--exchange`` times whole eager
calls of a ``CandidateExchange`` over the IPC transport, fused and as separate steps,
on every rank of the job (rank 0 prints), then profiles the fused ones.
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


def exchange(calls):
    from mpi4py import MPI

    from numba_cp.exchange import CandidateExchange, ExchangeConfig

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    small = numba_cp.backend.TARGET.simulator  # there, only that it runs
    work = decode_workload(heads=4, batch=2 if small else 64, query_len=1,
                           context=(16 if small else 1024) * 128)
    shard = device_copy(ref.shard_scores(work.full_scores, rank=rank, world=world,
                                         global_blocks=work.global_blocks))
    seq = device_copy(work.seq_lens)
    config = ExchangeConfig(heads=4, max_tokens=work.tokens, topk=16, world=world,
                            global_blocks=work.global_blocks, local_blocks=2)
    for fused in (True, False):
        with CandidateExchange(comm, config, transport="ipc", fused=fused) as plan:
            plan(shard, seq)
            numba_cp.backend.cuda.synchronize()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                plan(shard, seq)
            host = (time.perf_counter() - start) * 1e6 / calls
            numba_cp.backend.cuda.synchronize()
            every = comm.gather(host, root=0)
            if rank == 0:
                print(f"world {world} eager exchange, {'fused' if fused else 'separate'}: "
                      f"{max(every):.1f} us/call of host time (slowest rank; "
                      f"{calls} calls back to back)", flush=True)
            if fused:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(calls):
                    plan(shard, seq)
                profile.disable()
                numba_cp.backend.cuda.synchronize()
                if rank == 0:
                    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            comm.Barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--exchange", action="store_true",
                   help="time eager calls of the whole exchange (run under mpiexec)")
    args = p.parse_args()
    if args.exchange:
        exchange(args.calls)
        return
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
