"""The small-row kernels under a profiler, and the latency probes beside them.

    NUMBA_CP_BACKEND=cuda python benchmarks/profile_kernels.py probes [--cases a,b,g]
    NUMBA_CP_BACKEND=cuda python benchmarks/profile_kernels.py launch [--cases a,b,g] [--sass F]
        [--method M] [--addressed on|off]
    bash benchmarks/ncu_small_rows.sh            # Nsight Compute over ``launch``

``probes``: device µs per call (CUDA-graph replay, as bench_kernels.py) of the
pack and merge of each case (the pack and a merge with the table also with Numba's
array parameters, ``addressed=False``: ``pack_arrays``, ``merge_arrays``) beside probes
with the pack's grid and one warp per row: loads independent of seq_lens (``floor_indep``:
bench_kernels.py's floor probe), score loads that wait for seq_lens (``floor_dep``),
and the same after two int64 divisions (``floor_div64``); the floor with a parameter
block about
as large as the merge + table kernel's, seven more 3-D arrays and four scalars
(``floor_wide``), the same reading a word from every line of that block
(``floor_wide_read``); and with blocks of 64 and 128 threads that
trade their loads through shared memory across one barrier (``floor_barrier64``,
``floor_barrier128``), as the rank kernels' blocks do. Their differences price a
dependent memory round trip, a division chain and a block barrier in the kernels'
setting.

``launch``: a few eager calls of each case's pack and merge, for a profiler to
catch; ``--sass F`` also writes every compiled kernel's SASS to ``F`` with a
count of its instructions (``nvdisasm`` must be on the PATH).
"""

from __future__ import annotations

import argparse
import sys

import numba_cp
from bench_kernels import CASES, case_arrays, device_us, floor_kernel, floor_row
from numba_cp import ops


def build(name, method="auto"):
    """``(pack, merge, table_on, shard, seq_lens, out)`` of a bench_kernels case; the
    pack and merge take more keywords (``addressed=``)."""
    topk, window, shard_args, a = case_arrays(name)
    table_on = CASES[name][6]
    tables = {k: a[k] for k in ("attention_block_table", "sparse_block_table_out",
                                "sparse_context_lens_out") if k in a}

    def pack(stream=None, **launch):
        numba_cp.local_topk_keys(a["scores"], a["seq_lens"], topk=topk, rank=0, out=a["out"],
                                 stream=stream, method=method, **shard_args, **launch)

    def merge(stream=None, **launch):
        numba_cp.merge_topk_keys(a["keys"], a["topk_idx"], a["seq_lens"], stream=stream,
                                 method=method, **window, **tables, **launch)

    return pack, merge, table_on, a["scores"], a["seq_lens"], a["out"]


def probe_kernels():
    from numba import cuda, int64

    read_row_write_row = floor_row()  # the floor's work, inlined

    @cuda.jit
    def floor_dep(scores, seq_lens, out):
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y
        lane = cuda.threadIdx.x
        n = seq_lens[row] // 128
        if lane < n and lane < scores.shape[2]:
            out[head, row, lane] = int(scores[head, row, lane] > 0) + n

    @cuda.jit
    def floor_div64(scores, seq_lens, out, q):
        row = int64(cuda.blockIdx.x)
        head = cuda.blockIdx.y
        lane = cuda.threadIdx.x
        request = row // q
        n = seq_lens[request]
        c = (n - request + 3) // (q + 3)
        if lane < scores.shape[2]:
            out[head, row, lane] = int(scores[head, row, lane] > 0) + n + c

    @cuda.jit
    def floor_barrier(scores, seq_lens, out):
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        shared = cuda.shared.array(128, int64)
        n = seq_lens[row]
        if tid < scores.shape[2]:
            shared[tid] = int(scores[head, row, tid] > 0) + n
        cuda.syncthreads()
        if tid < out.shape[2]:
            out[head, row, tid] = shared[(tid + 1) % cuda.blockDim.x]

    @cuda.jit
    def floor_wide(scores, seq_lens, out, x1, x2, x3, x4, x5, x6, x7, s1, s2, s3, s4):
        # The floor's work with about the merge + table kernel's parameter block
        # (Numba passes a 3-D array as 11 words): what the block itself costs.
        read_row_write_row(scores, seq_lens, out)

    @cuda.jit
    def floor_wide_read(scores, seq_lens, out, x1, x2, x3, x4, x5, x6, x7, s1, s2, s3, s4):
        # floor_wide, reading a shape word of each extra array and every scalar as a
        # kernel that uses all of its arrays does: the constant-bank lines of the
        # whole parameter block are fetched, not only the first ones.
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y
        lane = cuda.threadIdx.x
        n = seq_lens[row] + (x1.shape[2] + x2.shape[1] + x3.shape[0] + x4.shape[2]
                             + x5.shape[1] + x6.shape[0] + x7.shape[2] + s1 + s2 + s3 + s4)
        if lane < scores.shape[2] and lane < out.shape[2]:
            out[head, row, lane] = int(scores[head, row, lane] > 0) + n

    return floor_kernel(), floor_dep, floor_div64, floor_barrier, floor_wide, floor_wide_read


def probes(cases):
    import cupy
    from numba import cuda

    floor_indep, floor_dep, floor_div64, floor_barrier, floor_wide, floor_wide_read = \
        probe_kernels()
    for name in cases:
        pack, merge, table_on, shard, seq_lens, out = build(name)
        stream = cupy.cuda.Stream(non_blocking=True)
        numba_stream = cuda.external_stream(stream.ptr)
        probe_out = cupy.zeros_like(out)
        grid = (out.shape[1], out.shape[0])
        row = {"case": name}
        with stream:
            if not table_on:
                row["pack"] = device_us(pack, stream, 50, 20)
                row["pack_arrays"] = device_us(lambda s: pack(s, addressed=False),
                                               stream, 50, 20)
            row["merge"] = device_us(merge, stream, 50, 20)
            if table_on:
                row["merge_arrays"] = device_us(lambda s: merge(s, addressed=False),
                                                stream, 50, 20)
            row["floor_indep"] = device_us(
                lambda s: floor_indep[grid, 32, numba_stream](shard, seq_lens, probe_out),
                stream, 50, 20)
            row["floor_dep"] = device_us(
                lambda s: floor_dep[grid, 32, numba_stream](shard, seq_lens, probe_out),
                stream, 50, 20)
            for threads in (64, 128):  # the rank kernels' blocks: several warps, a barrier
                row[f"floor_barrier{threads}"] = device_us(
                    lambda s: floor_barrier[grid, threads, numba_stream](shard, seq_lens,
                                                                         probe_out),
                    stream, 50, 20)
            wide = (shard,) * 7 + (1, 2, 3, 4)
            row["floor_wide"] = device_us(
                lambda s: floor_wide[grid, 32, numba_stream](shard, seq_lens, probe_out, *wide),
                stream, 50, 20)
            row["floor_wide_read"] = device_us(
                lambda s: floor_wide_read[grid, 32, numba_stream](shard, seq_lens, probe_out,
                                                                  *wide),
                stream, 50, 20)
            row["floor_div64"] = device_us(
                lambda s: floor_div64[grid, 32, numba_stream](shard, seq_lens, probe_out, 1),
                stream, 50, 20)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)


def launch(cases, sass_path, method, addressed):
    import cupy

    for name in cases:
        pack, merge, table_on, *_ = build(name, method)
        for _ in range(2):
            if not table_on:
                pack(addressed=addressed)
            merge(addressed=addressed)
        cupy.cuda.runtime.deviceSynchronize()
    if not sass_path:
        return
    with open(sass_path, "w") as f:
        for cache in (ops._PACK_LAUNCHES, ops._MERGE_LAUNCHES):
            for launch_ in cache.values():
                kernel = launch_.kernel
                for text in kernel.inspect_sass().values():
                    count = sum(1 for line in text.splitlines()
                                if line.strip().startswith("/*") and ";" in line)
                    f.write(f"# {kernel.py_func.__name__} grid={launch_.grid} "
                            f"block={launch_.block} instructions={count}\n{text}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("probes", "launch"))
    p.add_argument("--cases", default="a,b,g", help="comma-separated bench_kernels.py cases")
    p.add_argument("--sass", default=None, help="launch: write the kernels' SASS here")
    p.add_argument("--method", choices=numba_cp.METHODS, default="auto",
                   help="launch: the kernel family")
    p.add_argument("--addressed", choices=("on", "off"), default=None,
                   help="launch: whether the pack and the merge with the table take their "
                        "arrays by address (default: the package's, on)")
    args = p.parse_args(argv)
    if numba_cp.backend.TARGET.simulator:
        raise SystemExit("profile_kernels.py profiles a GPU: run it with NUMBA_CP_BACKEND=cuda "
                         "on a GPU node")
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {sorted(CASES)}")
    if args.mode == "probes":
        probes(cases)
    else:
        launch(cases, args.sass, args.method,
               None if args.addressed is None else args.addressed == "on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
