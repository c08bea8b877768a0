"""Time the whole exchange per call, across ranks: pack -> all-gather -> merge as one plan.

    python benchmarks/bench_exchange.py --worlds 1,2,4,8 --cases b,e [--mps] [--json out.json]

The driver (this command) starts one MPI job per world (``mpiexec -n P``, this script
with ``--job``), collects every rank's figures, checks exactness, prints one table and
writes JSON (and a plot of µs per exchange against world with ``--plot``). With
``--mps`` it first starts a CUDA MPS daemon with private pipe and log directories, so
that ranks sharing one GPU run their kernels side by side instead of time-slicing the
GPU, and stops it at the end. The same command runs unchanged with one rank per GPU on
a multi-GPU node (each rank takes GPU ``local rank % GPUs``).

Per case, world and gather, every rank builds a ``CandidateExchange`` of the case's
shape (its ``world`` replaced by the job's), captures it once (one CUDA graph with a
device-side gather, two graphs around an MPI gather), and times it. The gathers
(``--gathers``): ``ipc-fused``, the IPC transport fused into the pack and merge kernels
(two kernels per exchange); ``ipc``, the same transport as separate launches between
them; ``staged``, MPI through pinned host buffers; any other transport by name; and
``two-level``, the two-level exchange (``hierarchy="node"``: inside each node, then the
nodes' keys over MPI; ``NUMBA_CP_NODES`` pretends nodes on one machine) with its node
level as separate steps, and ``two-level-fused`` with the node level fused over IPC (two
graphs around the nodes' MPI gather); and
``alone``, every rank running the same kernels on its shard as a world of its own (checked
against the shard's oracle), with nothing exchanged: what ``P`` processes get from the
GPUs they share, the floor under any exchange among them.

``replay µs``
    ``--replays`` back-to-back replays on every rank with one synchronisation at the end:
    the time per exchange when nothing on the host waits, as a decode loop would run it.
``iteration µs``
    one replay per host iteration, each followed by a stream synchronisation and a
    barrier: what a caller that waits for every result pays.
``eager host µs``
    the host time of one eager call of the plan (``plan(scores, seq_lens)``, no
    graph), over ``--iterations`` calls with a synchronisation and a barrier after
    each, the synchronisation not counted.

All three are the slowest rank's. After timing, the outputs of the last replay are checked
against the unsharded oracle (``exact``). Under the simulator the figures only show
that the flow runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GATHERS = ("ipc-fused", "ipc", "staged", "alone")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4", help="comma-separated rank counts")
    p.add_argument("--cases", default="b", help="comma-separated cases of bench_kernels.py")
    p.add_argument("--gathers", default=",".join(GATHERS),
                   help="comma-separated gathers for world > 1: ipc-fused, or a transport "
                        "name, run as separate steps (world 1 gathers nothing)")
    p.add_argument("--replays", type=int, default=200, help="back-to-back replays timed")
    p.add_argument("--iterations", type=int, default=50, help="host iterations timed")
    p.add_argument("--mps", action="store_true", help="start (and stop) a CUDA MPS daemon")
    p.add_argument("--mpiexec", default=os.environ.get("NUMBA_CP_MPIEXEC", "mpiexec"),
                   help="launcher command, with its flags (default $NUMBA_CP_MPIEXEC, "
                        "else mpiexec)")
    p.add_argument("--small", action="store_true",
                   help="shrink every case to a few blocks and rows (for the simulator)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--plot", default=None, help="write a PNG of µs per exchange here")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a rank's JSON output
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# One MPI job: every rank runs every (case, transport) and reports.


def case_shape(name, world, small):
    from bench_kernels import CASES, INIT_BLOCKS, LOCAL_BLOCKS

    context, _, topk, batch, query_len, heads, table = CASES[name]
    if small:
        context, batch, topk = 16 * 128, 2, min(topk, 8)
    return dict(context=context, topk=topk, batch=batch, query_len=query_len, heads=heads,
                table=table, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS, world=world)


def run_job(args):
    import numpy as np
    from mpi4py import MPI

    import numba_cp
    from numba_cp import reference as ref
    from numba_cp.arrays import device_copy, host_copy
    from numba_cp.exchange import CandidateExchange, ExchangeConfig
    from numba_cp.workload import decode_workload

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    simulator = numba_cp.backend.TARGET.simulator
    cupy = None
    if not simulator:
        import cupy

        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        device = local.Get_rank() % cupy.cuda.runtime.getDeviceCount()
        local.Free()
        cupy.cuda.Device(device).use()
        numba_cp.backend.cuda.select_device(device)

    def sync(stream):
        if stream is not None:
            stream.synchronize()

    rows = []
    gathers = ["none"] if world == 1 else args.gathers.split(",")
    for name in args.cases.split(","):
        shape = case_shape(name, world, args.small)
        work = decode_workload(heads=shape["heads"], batch=shape["batch"],
                               query_len=shape["query_len"], context=shape["context"])
        window = dict(query_len=shape["query_len"], init_blocks=shape["init_blocks"],
                      local_blocks=shape["local_blocks"])
        shard = ref.shard_scores(work.full_scores, rank=rank, world=world,
                                 global_blocks=work.global_blocks)
        scores, seq_lens = device_copy(np.ascontiguousarray(shard)), device_copy(work.seq_lens)
        table = None
        if shape["table"]:
            host_table = np.random.default_rng(1).integers(
                0, 1 << 20, size=(shape["batch"], work.global_blocks), dtype=np.int32)
            table = device_copy(host_table)
        want = ref.global_topk(work.full_scores, work.seq_lens, topk=shape["topk"],
                               global_blocks=work.global_blocks, **window)
        config = ExchangeConfig(heads=shape["heads"], max_tokens=work.tokens,
                                topk=shape["topk"], world=world,
                                global_blocks=work.global_blocks, sparse_table=shape["table"],
                                **window)
        for gather in gathers:
            transport = {"none": None, "ipc-fused": "ipc", "alone": None,
                         "two-level": None, "two-level-fused": "ipc"}.get(gather, gather)
            group, plan_config, expected = comm, config, want
            if gather.startswith("two-level"):  # nodes: shared memory, or NUMBA_CP_NODES
                plan_config = dataclasses.replace(config, hierarchy="node")
            if gather == "alone":  # this rank's shard as a world of its own: nothing moves
                group = MPI.COMM_SELF
                plan_config = dataclasses.replace(config, world=1, global_blocks=shard.shape[2])
                expected = ref.global_topk(shard, work.seq_lens, topk=shape["topk"],
                                           global_blocks=shard.shape[2], **window)
            stream = None if simulator else cupy.cuda.Stream(non_blocking=True)
            with CandidateExchange(group, plan_config, transport=transport,
                                   fused=gather in ("ipc-fused", "two-level-fused")) as plan:
                captured = plan.capture(scores, seq_lens, attention_block_table=table,
                                        stream=stream)
                for _ in range(3):
                    captured.replay()
                sync(stream)
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(args.replays):
                    captured.replay()
                sync(stream)
                replay_us = (time.perf_counter() - start) / args.replays * 1e6
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(args.iterations):
                    captured.replay()
                    sync(stream)
                    comm.Barrier()
                iteration_us = (time.perf_counter() - start) / args.iterations * 1e6
                out = captured.replay()
                sync(stream)
                plan.check()
                idx = host_copy(out[0] if shape["table"] else out)
                exact = bool((idx == expected).all())
                eager = []
                for _ in range(args.iterations):
                    start = time.perf_counter()
                    out = plan(scores, seq_lens, attention_block_table=table, stream=stream)
                    eager.append(time.perf_counter() - start)
                    sync(stream)
                    comm.Barrier()
                plan.check()
                idx = host_copy(out[0] if shape["table"] else out)
                exact = exact and bool((idx == expected).all())
                eager_us = float(np.median(eager)) * 1e6
                fused = plan.fused
            rows.append(dict(case=name, world=world, gather=gather, fused=fused,
                             replay_us=replay_us, iteration_us=iteration_us,
                             eager_host_us=eager_us, exact=exact, shape=shape))
    everyone = comm.gather(rows, root=0)
    if rank == 0:
        merged = []
        for i, row in enumerate(everyone[0]):
            ranks = [rank_rows[i] for rank_rows in everyone]
            figures = ("replay_us", "iteration_us", "eager_host_us")
            merged.append(dict(row, **{f: max(r[f] for r in ranks) for f in figures},
                               exact=all(r["exact"] for r in ranks),
                               per_rank=[{f: r[f] for f in figures} for r in ranks]))
        Path(args.job).write_text(json.dumps(merged))


# ---------------------------------------------------------------------------
# The driver


class MPS:
    """A CUDA MPS control daemon with private pipe and log directories."""

    def __init__(self):
        self.dirs = None

    def start(self):
        if shutil.which("nvidia-cuda-mps-control") is None:
            raise SystemExit("--mps: nvidia-cuda-mps-control is not on PATH (CUDA MPS needs "
                             "an NVIDIA driver with MPS); run without --mps")
        self.dirs = {var: tempfile.mkdtemp(prefix="numba_cp_mps_")
                     for var in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
        os.environ.update(self.dirs)
        proc = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"--mps: nvidia-cuda-mps-control -d failed: "
                             f"{(proc.stderr or proc.stdout).strip()}")

    def stop(self):
        if self.dirs is not None:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True,
                           capture_output=True)
            for var in self.dirs:
                os.environ.pop(var, None)
            self.dirs = None


def launcher(args, world):
    command = args.mpiexec.split()
    if os.geteuid() == 0 and "open mpi" in subprocess.run(
            [command[0], "--version"], capture_output=True, text=True).stdout.lower():
        command += ["--allow-run-as-root", "--oversubscribe"]
        # Open MPI passes on only what -x names
        for var in sorted(os.environ):
            if var.startswith(("NUMBA_CP_", "CUDA_MPS_")) or var == "PYTHONPATH":
                command += ["-x", var]
    return command + ["-n", str(world)]


def print_table(rows, mps):
    print(f"per exchange, slowest rank; ranks share {'one GPU under MPS' if mps else 'the GPUs'}"
          " (or the CPU simulator)")
    print(f"{'case':>4} {'world':>5} {'gather':>9} {'replay us':>10} {'iteration us':>13} "
          f"{'eager host us':>14} {'exact':>6}")
    for r in rows:
        print(f"{r['case']:>4} {r['world']:>5} {r['gather']:>9} {r['replay_us']:>10.1f} "
              f"{r['iteration_us']:>13.1f} {r['eager_host_us']:>14.1f} {str(r['exact']):>6}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for case in sorted({r["case"] for r in rows}):
        for gather in sorted({r["gather"] for r in rows if r["world"] > 1}):
            points = sorted((r["world"], r["replay_us"]) for r in rows if r["case"] == case
                            and r["gather"] in (gather, "none"))
            ax.plot(*zip(*points), marker="o", label=f"{case} {gather}")
    ax.set_xlabel("ranks")
    ax.set_ylabel("µs per exchange (back-to-back replays)")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.job:
        run_job(args)
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    worlds = [int(w) for w in args.worlds.split(",")]
    mps = MPS()
    rows, failed = [], []
    try:
        if args.mps:
            mps.start()
        for world in worlds:
            with tempfile.TemporaryDirectory() as tmp:
                job = os.path.join(tmp, "job.json")
                command = launcher(args, world) + [
                    sys.executable, str(Path(__file__)), "--job", job, "--cases", args.cases,
                    "--gathers", args.gathers, "--replays", str(args.replays),
                    "--iterations", str(args.iterations)] + (["--small"] if args.small else [])
                print(f"== world {world}: {' '.join(command)}", flush=True)
                proc = subprocess.run(command, capture_output=True, text=True)
                if proc.returncode != 0 or not os.path.exists(job):
                    # Report it and go on: the other worlds' figures still stand.
                    print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
                    print(f"the world-{world} job failed (exit {proc.returncode})", flush=True)
                    failed.append(world)
                    continue
                rows += json.loads(Path(job).read_text())
    finally:
        mps.stop()
    print_table(rows, args.mps)
    if failed:
        print(f"failed: world {', '.join(map(str, failed))}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(argv=sys.argv[1:], mps=args.mps, rows=rows,
                                                   failed_worlds=failed), indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["exact"] for r in rows) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
