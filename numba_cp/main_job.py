"""The package's main job: the CP candidate exchange as an MPI experiment.

    mpiexec -n 4 numba-cp-exchange [--context 128K --topk 16 ...]
    mpiexec -n 4 python -m numba_cp.main_job [...]       (the same)

Every rank builds the same seeded full-context index scores (or loads them
from ``--scores``), takes its round-robin shard, and runs the exchange
(pack -> all-gather -> merge) through a :class:`numba_cp.CandidateExchange`.
Rank 0 checks the merged top-k against the unsharded NumPy oracle and prints
a header (versions, backend, MPI, the device of every rank, the transport and
why), the timing table and the verdict, EXACT or INEXACT, last. ``--json``
writes everything, per-rank raw timings included; ``--plot`` draws a context
sweep. Exit status: 0 exact, 1 inexact, 2 bad option or error.

Options are checked before any MPI work (:mod:`numba_cp.job_options`); past
that, a rank that fails aborts the job, since its peers would otherwise wait
in a collective.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import sys
import time
import traceback

import numpy as np

from . import backend
from . import job_report as report
from .job_options import OptionError, check_with_world, parse_options, report_option_error

__all__ = ["cli", "main"]

SIM = backend.TARGET.simulator


def _import_mpi():
    """mpi4py.MPI, or a one-line exit when mpi4py finds no MPI library."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # one line
        report_option_error(f"mpi4py could not load an MPI library ({why}); install one "
                            "(pip install 'numba_cp[mpich]') or load the site's MPI module")
        sys.exit(2)
    return MPI


def exchange_config(args, world: int, context: int):
    """The ExchangeConfig every rank builds for ``context``, from the options alone."""
    from .exchange import ExchangeConfig

    if getattr(args, "loaded", None) is not None:
        scores, _ = args.loaded
        heads, tokens, blocks = scores.shape
    else:
        heads, tokens, blocks = args.heads, args.batch * args.query_len, context // 128
    return ExchangeConfig(heads=heads, max_tokens=tokens, topk=args.topk, world=world,
                          global_blocks=blocks, init_blocks=args.init_blocks,
                          local_blocks=args.local_blocks, query_len=args.query_len,
                          sparse_table=args.sparse_table, merge=args.merge,
                          hierarchy=args.hierarchy)


def bind_local_device(comm, MPI) -> str:
    """One GPU per rank of a node: the node-local rank modulo the GPUs it sees.

    Every rank of a node sees all of the node's GPUs (the Slurm example asks for
    --gpus-per-node, not a GPU per task), so ranks can map each other's memory.
    """
    if SIM:
        return "cpu (simulator)"
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = local.Get_rank()
    local.Free()
    import cupy

    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    backend.cuda.select_device(device)
    name = backend.cuda.get_current_device().name
    return f"gpu{device} {name.decode() if isinstance(name, bytes) else name}"


def synchronize():
    if not SIM:
        backend.cuda.synchronize()


def load_workload(args, context):
    from .workload import Workload, decode_workload

    if getattr(args, "loaded", None) is None:
        return decode_workload(heads=args.heads, batch=args.batch, query_len=args.query_len,
                               context=context, seed=args.seed)
    scores, seq_lens = args.loaded
    return Workload(scores, seq_lens, args.query_len, scores.shape[2])


def say(comm, *lines):
    if comm.Get_rank() == 0:
        for line in lines:
            print(line, flush=True)


def run_once(comm, args, work, config, first: bool):
    """One context: time pack, all-gather and merge (and replays); returns rank 0's
    summary (None elsewhere) and whether every output was exact."""
    from . import reference as ref
    from .arrays import device_copy, host_copy
    from .exchange import CandidateExchange

    world, rank = comm.Get_size(), comm.Get_rank()
    shard = device_copy(ref.shard_scores(work.full_scores, rank=rank, world=world,
                                         global_blocks=work.global_blocks))
    seq_lens = device_copy(work.seq_lens)
    table = table_host = None
    if args.sparse_table:
        table_host = np.random.default_rng(args.seed + 1).integers(
            0, 1 << 20, size=(work.seq_lens.size, work.global_blocks), dtype=np.int32)
        table = device_copy(table_host)
    first_call_s = None
    with CandidateExchange(comm, config, transport=args.transport,
                           method=args.method, threads=args.threads) as plan:
        if first:
            say(comm, f"transport: {plan.describe()}")
        if args.fail_rank == rank:
            # SystemExit, not an Exception: the driver must abort on it all the same
            raise SystemExit(f"--fail-rank {rank}: failing on purpose")
        timings = np.zeros((args.iters, len(report.STAGES)))
        for it in range(args.warmup + args.iters):
            if first and it == 0:
                say(comm, "first call: " + ("the simulator interprets the kernels (nothing to "
                                            "compile) ..." if SIM else
                                            "compiling kernels (or loading them from the "
                                            "kernel cache) ..."))
            comm.Barrier()
            t0 = time.perf_counter()
            plan.pack(shard, seq_lens)
            synchronize()
            t1 = time.perf_counter()
            plan.all_gather(work.tokens, seq_lens=seq_lens)
            synchronize()
            t2 = time.perf_counter()
            result = plan.merge(seq_lens, work.tokens, attention_block_table=table)
            synchronize()
            t3 = time.perf_counter()
            if first and it == 0:
                first_call_s = t3 - t0
                say(comm, f"first call: {first_call_s:.1f} s on rank 0")
            if it >= args.warmup:
                timings[it - args.warmup] = (t1 - t0, t2 - t1, t3 - t2, t3 - t0)
        plan.check()  # a device-side gather that gave up raises here, on every rank
        transport = plan.describe()
        heads = plan.heads
        outputs = tuple(host_copy(x) for x in (result if args.sparse_table else (result,)))
        replays = None
        if args.graph:
            replays, replayed = time_replays(comm, args, plan, shard, seq_lens, table)
            outputs += tuple(host_copy(x) for x in
                             (replayed if args.sparse_table else (replayed,)))

    gathered = comm.gather((heads.start, heads.stop, outputs, timings, replays), root=0)
    exact, summary = None, None
    if rank == 0:
        exact = check(gathered, work, args, table_host)
        summary = summarise(gathered, work, config, exact, transport, first_call_s)
    exact = comm.bcast(exact, root=0)
    return summary, exact


def time_replays(comm, args, plan, shard, seq_lens, table):
    """Graph replays timed two ways: one per host iteration (replay, then a stream
    synchronisation), and ``--replays`` back to back with one synchronisation at the
    end, per exchange. Returns ``([iters, 2] seconds, the last replay's outputs)``."""
    captured = plan.capture(shard, seq_lens, attention_block_table=table)
    times = np.zeros((args.iters, len(report.REPLAY_STAGES)))
    for it in range(args.warmup + args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        replayed = captured.replay()
        synchronize()
        if it >= args.warmup:
            times[it - args.warmup, 0] = time.perf_counter() - t0
    for it in range(args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.replays):
            replayed = captured.replay()
        synchronize()
        times[it, 1] = (time.perf_counter() - t0) / args.replays
    return times, replayed


def check(gathered, work, args, table) -> bool:
    from . import reference as ref

    window = dict(query_len=work.query_len, init_blocks=args.init_blocks,
                  local_blocks=args.local_blocks)
    unsharded = ref.global_topk(work.full_scores, work.seq_lens, topk=args.topk,
                                global_blocks=work.global_blocks, **window)
    expected = [unsharded]
    if table is not None:
        expected += list(ref.sparse_block_table(unsharded, work.seq_lens, table,
                                                query_len=work.query_len))
    ok = True
    for start, stop, outputs, *_ in gathered:
        for i, got in enumerate(outputs):  # eager outputs, then the graph replay's
            ok &= bool(np.array_equal(got, expected[i % len(expected)][start:stop]))
    return ok


def summarise(gathered, work, config, exact, transport, first_call_s) -> dict:
    """Rank 0's record of one context: statistics, raw per-rank timings, payload."""
    per_rank = {stage: np.stack([g[3][:, i] for g in gathered])
                for i, stage in enumerate(report.STAGES)}
    if gathered[0][4] is not None:
        per_rank.update({stage: np.stack([g[4][:, i] for g in gathered])
                         for i, stage in enumerate(report.REPLAY_STAGES)})
    stages = {stage: report.stage_statistics(seconds) for stage, seconds in per_rank.items()}
    return dict(
        context=int(work.global_blocks * 128), tokens=int(work.tokens), exact=exact,
        transport=transport, config=dataclasses.asdict(config), stages=stages,
        all_gather=report.gather_payload(world=config.world, heads=config.heads,
                                         tokens=work.tokens, keys=config.shard_keys,
                                         median_us=stages["all_gather"]["median_us"]),
        per_rank_us={stage: (seconds * 1e6).round(3).tolist()
                     for stage, seconds in per_rank.items()},
        first_call_s=first_call_s)


def header(comm, MPI, ranks) -> dict:
    """What ran where, for the printed header and the JSON."""
    from .kernel_cache import cache_location

    library = MPI.Get_library_version()
    return dict(
        versions=report.package_versions(),
        backend=backend.TARGET.name, backend_description=backend.describe(),
        simulator=SIM, driver=report.driver_version(backend.TARGET.name),
        mpi=dict(library=report.mpi_library_name(library),
                 standard="{}.{}".format(*MPI.Get_version()),
                 library_version=" ".join(library.replace("\x00", "").split())),
        world=comm.Get_size(), ranks=ranks, hosts=sorted({r["host"] for r in ranks}),
        command=report.command_line(), cwd=os.getcwd(),
        kernel_cache=cache_location(),
    )


def print_header(info, args) -> None:
    v = info["versions"]
    stack = ", ".join(f"{name} {version}" for name, version in v.items()
                      if name not in ("numba_cp", "python"))
    print(f"numba_cp {v['numba_cp']} main job: CP candidate exchange "
          "(pack -> all-gather -> merge)")
    print(f"versions: Python {v['python']}, {stack}")
    print(f"backend: {info['backend_description']} | driver: {info['driver']}")
    print(f"MPI: {info['mpi']['library']} (MPI {info['mpi']['standard']}) | world "
          f"{info['world']} on {len(info['hosts'])} host{'s' if len(info['hosts']) > 1 else ''}")
    print("devices:")
    for line in report.format_ranks(info["ranks"]):
        print(line)
    if info["kernel_cache"]:
        print(f"kernel cache: {info['kernel_cache']}")
    print(f"command: {shlex.join(info['command'])}", flush=True)


def print_run(run, args, index) -> None:
    c = run["config"]
    print(f"shape: heads={c['heads']} tokens={c['max_tokens']} "
          f"(batch {c['max_tokens'] // c['query_len']} x query_len {c['query_len']}) "
          f"context={run['context']} global_blocks={c['global_blocks']} topk={c['topk']} "
          f"merge={c['merge']} sparse_table={c['sparse_table']} hierarchy={c['hierarchy']}")
    for line in report.format_timings(run, iters=args.iters, warmup=args.warmup,
                                      replays=args.replays if args.graph else None,
                                      simulator=SIM, explain=index == 0):
        print(line)
    print(("exact" if run["exact"] else "INEXACT") + f" at context {run['context']}",
          flush=True)


def main(args, comm, MPI) -> int:
    world, rank = comm.Get_size(), comm.Get_rank()
    device = bind_local_device(comm, MPI)
    ranks = comm.gather(dict(rank=rank, host=socket.gethostname(), device=device), root=0)
    info = header(comm, MPI, ranks) if rank == 0 else None
    if rank == 0:
        print_header(info, args)
    results, exact = [], True
    for i, context in enumerate(args.contexts):
        if len(args.contexts) > 1:
            say(comm, f"[{i + 1}/{len(args.contexts)}] context {context} ...")
        work = load_workload(args, context)
        config = exchange_config(args, world, context)
        summary, context_exact = run_once(comm, args, work, config, first=i == 0)
        exact &= context_exact
        if rank == 0:
            results.append(summary)
            print_run(summary, args, i)
    if rank == 0:
        if args.json:
            payload = dict(format=report.JSON_FORMAT, numba_cp=info["versions"]["numba_cp"],
                           date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), exact=exact,
                           transport=results[0]["transport"], iters=args.iters,
                           warmup=args.warmup, replays=args.replays if args.graph else None,
                           aggregation=report.AGGREGATION, **info,
                           stages=results[-1]["stages"], runs=results)
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
            print(f"wrote {args.json}")
        if args.plot:
            report.plot_sweep(results, args.plot, world=world, backend=backend.TARGET.name,
                              replays=args.replays if args.graph else None)
            print(f"wrote {args.plot}")
        print("EXACT: merged top-k equals the unsharded oracle" if exact else
              "INEXACT: merged top-k differs from the unsharded oracle", flush=True)
    return 0 if exact else 1


def cli(argv=None) -> None:
    """The console command ``numba-cp-exchange``; exits with the job's status."""
    try:
        args = parse_options(argv)
    except OptionError as exc:
        report_option_error(str(exc))
        sys.exit(2)
    MPI = _import_mpi()
    comm = MPI.COMM_WORLD
    try:  # the same verdict on every rank, before any collective: no abort needed
        check_with_world(args, comm.Get_size(),
                         lambda context: exchange_config(args, comm.Get_size(), context))
    except OptionError as exc:
        if comm.Get_rank() == 0:
            report_option_error(str(exc))
        sys.exit(2)
    from .errors import RankAgreementError

    try:
        status = main(args, comm, MPI)
    except RankAgreementError as exc:
        # Raised the same on every rank (mismatched configuration): each rank
        # says so and exits; nobody is left waiting, so no abort is needed.
        print(f"rank {comm.Get_rank()}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        sys.exit(2)
    except BaseException:
        # One failing rank must end the whole job, never leave the others waiting
        # in a collective: print, then abort the communicator. That holds for
        # SystemExit and KeyboardInterrupt too: past the checks, only this rank has them.
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(2)
        os._exit(2)  # Abort may return before the launcher kills this process
    sys.exit(status)


if __name__ == "__main__":
    cli()
