"""The CP candidate exchange as an MPI experiment: the package's main job.

    mpiexec -n 4 python launch/exchange.py [--context 128K --topk 16 ...]

Every rank builds the same seeded full-context index scores (or loads them from
``--scores``), takes its round-robin shard, and runs the exchange
(pack -> all-gather -> merge) through a :class:`numba_cp.CandidateExchange`.
Rank 0 checks the merged top-k against the unsharded NumPy oracle, prints
EXACT or INEXACT and a per-stage timing table (median and p90 over iterations
of the slowest rank), and optionally writes JSON (``--json``) and, for a
context sweep, a plot (``--plot``). Exit status: 0 exact, 1 inexact, 2 error.

Defaults are a realistic decode shape on a GPU and a small one under the CPU
simulator, where the same run finishes in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import numpy as np


from mpi4py import MPI

import numba_cp
from numba_cp import reference as ref
from numba_cp.arrays import device_copy, host_copy
from numba_cp.errors import RankAgreementError
from numba_cp.exchange import CandidateExchange, ExchangeConfig
from numba_cp.workload import Workload, decode_workload

SIM = numba_cp.backend.TARGET.simulator
DEFAULTS = (dict(heads=2, batch=8, context="16K", topk=16, iters=3, warmup=1) if SIM else
            dict(heads=4, batch=64, context="128K", topk=16, iters=50, warmup=5))
STAGES = ("pack", "all_gather", "merge", "total")


def tokens_count(text: str) -> int:
    """'128K' -> 131072; '1M' -> 1048576; plain integers as they are."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        return int(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 32768, 32K, 1M)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="CP candidate exchange under MPI: exactness check and per-stage timings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="index heads")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="requests per step")
    p.add_argument("--query-len", type=int, default=1,
                   help="query tokens per request (>1: speculative/MTP rows)")
    p.add_argument("--context", type=tokens_count, default=DEFAULTS["context"],
                   help="longest context in tokens (a multiple of 128; 32K, 1M accepted)")
    p.add_argument("--topk", type=int, default=DEFAULTS["topk"], help="blocks selected per row")
    p.add_argument("--init-blocks", type=int, default=1, help="pinned sink blocks")
    p.add_argument("--local-blocks", type=int, default=2, help="pinned most-recent blocks")
    p.add_argument("--merge", choices=("all", "owned"), default="all",
                   help="merge every head on every rank, or only this rank's slice of heads")
    p.add_argument("--sparse-table", action="store_true",
                   help="also emit the paged sparse block table (checked against the oracle)")
    p.add_argument("--transport", default=None,
                   help="force an all-gather transport (host, mpi-device, staged, ipc, "
                        "nccl); default: the best for this machine")
    p.add_argument("--graph", action="store_true",
                   help="also capture the exchange (CUDA/HIP graph) and time its replays; with "
                        "an MPI gather, pack and merge are two graphs around it")
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"], help="timed iterations")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"],
                   help="untimed iterations first (kernel compilation happens here)")
    p.add_argument("--seed", type=int, default=0, help="workload seed, the same on every rank")
    p.add_argument("--scores", default=None,
                   help="load full-context scores float32 [heads, tokens, blocks] from .npy "
                        "(then --seq-lens is required; --heads/--batch/--context follow it)")
    p.add_argument("--seq-lens", default=None, help="int32 [requests] .npy for --scores")
    p.add_argument("--sweep-context", type=lambda s: [tokens_count(x) for x in s.split(",")],
                   default=None, help="comma-separated contexts to run one after another, "
                                      "e.g. 8K,32K,128K")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG of the sweep here (matplotlib)")
    p.add_argument("--method", choices=("auto", "warp", "radix"), default="auto",
                   help="kernel family (numba_cp.METHODS)")
    p.add_argument("--threads", type=int, default=None, help="threads per kernel block")
    p.add_argument("--fail-rank", type=int, default=None,
                   help="(testing) raise on this rank after setup, to show the job aborts")
    return p.parse_args(argv)


def bind_local_device(comm) -> str:
    """One GPU per rank on a node: local rank modulo the visible devices."""
    if SIM:
        return "cpu"
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = local.Get_rank()
    local.Free()
    import cupy

    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    numba_cp.backend.cuda.select_device(device)
    return f"gpu{device}"


def synchronize():
    if not SIM:
        numba_cp.backend.cuda.synchronize()


def load_workload(args) -> Workload:
    if args.scores is None:
        return decode_workload(heads=args.heads, batch=args.batch, query_len=args.query_len,
                               context=args.context, seed=args.seed)
    if args.seq_lens is None:
        raise SystemExit("--scores needs --seq-lens")
    scores = np.load(args.scores).astype(np.float32, copy=False)
    seq_lens = np.load(args.seq_lens).astype(np.int32, copy=False)
    if scores.ndim != 3 or seq_lens.ndim != 1:
        raise SystemExit("--scores must be [heads, tokens, blocks], --seq-lens [requests]")
    return Workload(scores, seq_lens, args.query_len, scores.shape[2])


def run_once(comm, args, work: Workload):
    world, rank = comm.Get_size(), comm.Get_rank()
    config = ExchangeConfig(
        heads=work.heads, max_tokens=work.tokens, topk=args.topk, world=world,
        global_blocks=work.global_blocks, init_blocks=args.init_blocks,
        local_blocks=args.local_blocks, query_len=work.query_len,
        sparse_table=args.sparse_table, merge=args.merge)
    shard = device_copy(ref.shard_scores(work.full_scores, rank=rank, world=world,
                                         global_blocks=work.global_blocks))
    seq_lens = device_copy(work.seq_lens)
    table = None
    if args.sparse_table:
        table_host = np.random.default_rng(args.seed + 1).integers(
            0, 1 << 20, size=(work.seq_lens.size, work.global_blocks), dtype=np.int32)
        table = device_copy(table_host)
    with CandidateExchange(comm, config, transport=args.transport,
                           method=args.method, threads=args.threads) as plan:
        if args.fail_rank == rank:
            # SystemExit, not an Exception: the driver must abort on it all the same
            raise SystemExit(f"--fail-rank {rank}: failing on purpose")
        timings = np.zeros((args.iters, 4))
        for it in range(args.warmup + args.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            plan.pack(shard, seq_lens)
            synchronize()
            t1 = time.perf_counter()
            plan.all_gather(work.tokens)
            synchronize()
            t2 = time.perf_counter()
            result = plan.merge(seq_lens, work.tokens, attention_block_table=table)
            synchronize()
            t3 = time.perf_counter()
            if it >= args.warmup:
                timings[it - args.warmup] = (t1 - t0, t2 - t1, t3 - t2, t3 - t0)
        plan.check()  # a device-side gather that gave up raises here, on every rank
        transport = plan.describe()
        heads = plan.heads
        outputs = tuple(host_copy(x) for x in (result if args.sparse_table else (result,)))
        replay_times = None
        if args.graph:
            captured = plan.capture(shard, seq_lens, attention_block_table=table)
            replay_times = np.zeros(args.iters)
            for it in range(args.warmup + args.iters):
                comm.Barrier()
                t0 = time.perf_counter()
                replayed = captured.replay()
                synchronize()
                if it >= args.warmup:
                    replay_times[it - args.warmup] = time.perf_counter() - t0
            outputs += tuple(host_copy(x) for x in
                             (replayed if args.sparse_table else (replayed,)))

    if replay_times is not None:
        timings = np.concatenate([timings, replay_times[:, None]], axis=1)
    gathered = comm.gather((heads.start, heads.stop, outputs, timings), root=0)
    exact = None
    summary = None
    if rank == 0:
        exact = check(gathered, work, args, table_host if args.sparse_table else None)
        per_rank = np.stack([t for *_, t in gathered])  # [world, iters, stages]
        slowest = per_rank.max(axis=0)  # the critical path of each iteration
        stages = STAGES + (("graph_replay",) if args.graph else ())
        summary = {stage: {"median_us": float(np.median(slowest[:, i]) * 1e6),
                           "p90_us": float(np.percentile(slowest[:, i], 90) * 1e6)}
                   for i, stage in enumerate(stages)}
    exact = comm.bcast(exact, root=0)
    return dict(context=int(work.global_blocks * 128), exact=exact, transport=transport,
                stages=summary, config=dataclasses.asdict(config))


def check(gathered, work, args, table) -> bool:
    window = dict(query_len=work.query_len, init_blocks=args.init_blocks,
                  local_blocks=args.local_blocks)
    unsharded = ref.global_topk(work.full_scores, work.seq_lens, topk=args.topk,
                                global_blocks=work.global_blocks, **window)
    expected = [unsharded]
    if table is not None:
        expected += list(ref.sparse_block_table(unsharded, work.seq_lens, table,
                                                query_len=work.query_len))
    ok = True
    for start, stop, outputs, _ in gathered:
        for i, got in enumerate(outputs):  # eager outputs, then the graph replay's
            ok &= bool(np.array_equal(got, expected[i % len(expected)][start:stop]))
    return ok


def print_table(result):
    print(f"{'stage':<12}{'median us':>12}{'p90 us':>12}")
    for stage, s in result["stages"].items():
        print(f"{stage:<12}{s['median_us']:>12.1f}{s['p90_us']:>12.1f}")


def plot(results, path, world):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [r["context"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in STAGES:
        ax.plot(contexts, [r["stages"][stage]["median_us"] for r in results], marker="o",
                label=stage)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("median time per step (us)")
    ax.set_title(f"CP candidate exchange, world={world}, {numba_cp.backend.TARGET.name}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    device = bind_local_device(comm)
    contexts = args.sweep_context or [args.context]
    if rank == 0:
        print(f"numba_cp {numba_cp.__version__} | backend {numba_cp.backend.describe()} | "
              f"world {world} | MPI {MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}")
    results = []
    for i, context in enumerate(contexts):
        args.context = context
        work = load_workload(args)
        if rank == 0 and len(contexts) > 1:
            print(f"[{i + 1}/{len(contexts)}] context {context} ...", flush=True)
        result = run_once(comm, args, work)
        results.append(result)
        if rank == 0:
            c = result["config"]
            if i == 0:
                print(f"transport: {result['transport']}")
            print(f"shape: heads={c['heads']} tokens={c['max_tokens']} "
                  f"(batch {c['max_tokens'] // c['query_len']} x query_len {c['query_len']}) "
                  f"context={context} global_blocks={c['global_blocks']} topk={c['topk']} "
                  f"merge={c['merge']} sparse_table={c['sparse_table']} ranks on {device}")
            print("EXACT: merged top-k equals the unsharded oracle" if result["exact"] else
                  "INEXACT: merged top-k differs from the unsharded oracle")
            print_table(result)
    exact = all(r["exact"] for r in results)
    if rank == 0:
        if args.json:
            payload = dict(world=world, backend=numba_cp.backend.TARGET.name,
                           transport=results[0]["transport"], exact=exact,
                           iters=args.iters, warmup=args.warmup, date=time.strftime("%Y-%m-%d"),
                           stages=results[-1]["stages"], runs=results)
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
            print(f"wrote {args.json}")
        if args.plot:
            plot(results, args.plot, world)
            print(f"wrote {args.plot}")
    return 0 if exact else 1


if __name__ == "__main__":
    # Every rank parses the same command line, so argparse's exit is every rank's.
    arguments = parse_args()
    try:
        status = main(arguments)
    except RankAgreementError as exc:
        # Raised the same on every rank (mismatched configuration): each rank
        # says so and exits; nobody is left waiting, so no abort is needed.
        print(f"rank {MPI.COMM_WORLD.Get_rank()}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        sys.exit(2)
    except BaseException:
        # One failing rank must end the whole job, never leave the others waiting
        # in a collective: print, then abort the communicator. That holds for
        # SystemExit and KeyboardInterrupt too: past parsing, only this rank has them.
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2)
        os._exit(2)  # Abort may return before the launcher kills this process
    sys.exit(status)
