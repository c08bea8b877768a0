"""Where a host call's time goes: cProfile over many eager calls (case b shapes).

    NUMBA_CP_BACKEND=cuda python benchmarks/profile_call.py [--calls 2000]
    NUMBA_CP_BACKEND=cuda python benchmarks/profile_call.py --torch [--json calls.json]
    NUMBA_CP_BACKEND=cuda mpiexec -n 2 python benchmarks/profile_call.py --exchange

The first times the two public kernels' wrappers; ``--torch`` then times the pack
and the merge at case b's shapes and case g's merge with its sparse block table
(bench_kernels.py's cases) three ways: with CuPy arrays, with PyTorch tensors, and
with the same tensors seen only through ``__cuda_array_interface__`` (what a
tensor costs without its own key), checks that the tensors' outputs equal the
CuPy ones, and prints a cProfile of g's calls with CuPy arrays and with tensors.
``--exchange`` times whole eager calls of a ``CandidateExchange`` over the IPC
transport, fused and as separate steps, on every rank of the job (rank 0
prints), and profiles each.
"""

import argparse
import cProfile
import json
import pstats
import time


import numpy as np

import numba_cp
from numba_cp import reference as ref
from numba_cp.arrays import device_copy
from numba_cp.workload import decode_workload

from bench_kernels import case_arrays


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
        label = "fused" if fused else "separate"
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
                print(f"world {world} eager exchange, {label}: "
                      f"{max(every):.1f} us/call of host time (slowest rank; "
                      f"{calls} calls back to back)", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(calls):
                plan(shard, seq)
            profile.disable()
            numba_cp.backend.cuda.synchronize()
            if rank == 0:
                print(f"rank 0, {calls} {label} calls:", flush=True)
                pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            comm.Barrier()


class ThroughInterface:
    """A tensor seen only through ``__cuda_array_interface__``, which PyTorch builds
    anew on every access: the host cost of an array with no key of its own."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    @property
    def __cuda_array_interface__(self):
        return self.tensor.__cuda_array_interface__


def comparison_calls(seed=0):
    """``[(label, call(arrays), CuPy arrays, output names)]``: the calls --torch times."""
    calls = []
    topk, window, shard_args, b = case_arrays("b", seed)

    def pack(a):
        numba_cp.local_topk_keys(a["scores"], a["seq_lens"], topk=topk, rank=0, out=a["out"],
                                 **shard_args)

    def merge(a):
        numba_cp.merge_topk_keys(a["keys"], a["topk_idx"], a["seq_lens"], **window)

    calls.append(("pack (b)", pack, {k: b[k] for k in ("scores", "seq_lens", "out")},
                  ("out",)))
    calls.append(("merge (b)", merge, {k: b[k] for k in ("keys", "topk_idx", "seq_lens")},
                  ("topk_idx",)))
    _, g_window, _, g = case_arrays("g", seed)
    tables = ("attention_block_table", "sparse_block_table_out", "sparse_context_lens_out")

    def merge_table(a):
        numba_cp.merge_topk_keys(a["keys"], a["topk_idx"], a["seq_lens"], **g_window,
                                 **{k: a[k] for k in tables})

    calls.append(("merge+table (g)", merge_table,
                  {k: g[k] for k in ("keys", "topk_idx", "seq_lens") + tables},
                  ("topk_idx", "sparse_block_table_out", "sparse_context_lens_out")))
    return calls


def host_us(call, arrays, calls, repeats):
    """Host us per eager call of ``call(arrays)``: the best of ``repeats`` runs of
    ``calls`` back to back, each ended by one synchronisation."""
    sync = numba_cp.backend.cuda.synchronize
    call(arrays)  # validation, compile and the first launch happen here, untimed
    sync()
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call(arrays)
        sync()
        took = (time.perf_counter() - start) * 1e6 / calls
        best = took if best is None else min(best, took)
    return best


def torch_comparison(calls, repeats, json_path=None):
    """Host us per call with CuPy arrays, PyTorch tensors, and tensors through the
    interface; prints a table, returns (and optionally writes) the rows."""
    try:
        import torch
    except ImportError:
        raise SystemExit("--torch needs PyTorch (with CUDA) installed") from None
    import cupy

    rows = []
    inputs = {}  # label -> (CuPy arrays, tensors)
    calls_made = comparison_calls()
    for label, call, cupy_arrays, outputs in calls_made:
        numba_cp.backend.cuda.synchronize()  # the keys, packed on CuPy's stream
        tensors = {k: torch.as_tensor(v, device="cuda").clone() for k, v in cupy_arrays.items()}
        for name in outputs:
            tensors[name].zero_()
        torch.cuda.synchronize()
        wrapped = {k: ThroughInterface(v) for k, v in tensors.items()}
        row = dict(call=label,
                   cupy_us=host_us(call, cupy_arrays, calls, repeats),
                   torch_us=host_us(call, tensors, calls, repeats),
                   torch_interface_us=host_us(call, wrapped, calls, repeats))
        row["torch_over_cupy"] = row["torch_us"] / row["cupy_us"]
        torch.cuda.synchronize()
        row["same_outputs"] = all(
            np.array_equal(tensors[name].cpu().numpy(), cupy.asnumpy(cupy_arrays[name]))
            for name in outputs)
        rows.append(row)
        inputs[label] = cupy_arrays, tensors
    print(f"host us per eager call ({calls} calls back to back, best of {repeats}): "
          "CuPy arrays, PyTorch tensors, and the tensors through __cuda_array_interface__")
    head = ("call", "cupy", "torch", "torch iface", "torch/cupy", "same")
    print(f"{head[0]:<16}" + "".join(f"{h:>12}" for h in head[1:]))
    for row in rows:
        print(f"{row['call']:<16}{row['cupy_us']:>12.1f}{row['torch_us']:>12.1f}"
              f"{row['torch_interface_us']:>12.1f}{row['torch_over_cupy']:>12.2f}"
              f"{'yes' if row['same_outputs'] else 'NO':>12}")
    label, call, _, _ = calls_made[-1]  # g's merge + table: the dearest call
    for kind, arrays in zip(("CuPy arrays", "PyTorch tensors"), inputs[label]):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            call(arrays)
        profile.disable()
        numba_cp.backend.cuda.synchronize()
        print(f"{label}, {calls} calls with {kind}:", flush=True)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    if json_path:
        result = dict(backend=numba_cp.backend.describe(), calls=calls, repeats=repeats,
                      torch=torch.__version__, cupy=cupy.__version__, rows=rows)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--exchange", action="store_true",
                   help="time eager calls of the whole exchange (run under mpiexec)")
    p.add_argument("--torch", action="store_true",
                   help="also time pack, merge and case g's merge with its table with CuPy "
                        "arrays and with PyTorch tensors")
    p.add_argument("--repeats", type=int, default=3,
                   help="--torch: runs of --calls per measurement; the best is kept")
    p.add_argument("--json", default=None, help="--torch: write its table here as JSON")
    args = p.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        p.error("--calls and --repeats must be >= 1")
    if args.json and not args.torch:
        p.error("--json writes the --torch table: add --torch")
    if args.exchange:
        exchange(args.calls)
        return
    if numba_cp.backend.TARGET.simulator:
        raise SystemExit("profile_call.py times a GPU's host calls: run it with "
                         "NUMBA_CP_BACKEND=cuda (or hip) on a GPU node (--exchange alone "
                         "also runs on the simulator)")
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
    if args.torch:
        torch_comparison(args.calls, args.repeats, args.json)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        pack()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
