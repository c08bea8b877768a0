"""Run under mpiexec by tests/comm/test_ipc_device.py: the device-side gathers end to end.

On a GPU target every rank may share one GPU (the processes then open each
other's IPC handles on the same device) or have its own. Rank 0 prints one
line per check, after every rank has reported on it::

    PASS  <check>  <detail>
    FAIL  <check>  rank(s) R: <what went wrong>; ...
    SKIP  <check>  <why>

and a last ``ipc_device_check: N passed, M failed, K skipped`` line. Exit
status: 0 when nothing failed, 1 otherwise (2: the job itself broke).

Checks:

``choose``
    ``choose_transport(comm, device=True)`` picks ``ipc`` (every rank on one
    node, CuPy IPC available); under the simulator it must *not* pick it.
``eager int64 keys``, ``eager float16``, ``eager uint8 odd bytes``, ``eager int64 tiny``
    ``IPCAllGather`` all-gathers rank-specific data exactly, several rounds
    (both halves of the double buffer, twice); the odd-sized uint8 payload
    takes the byte-wise path.
``eager fewer tokens``
    set up for ``(heads, tokens, topk)``, gathers of fewer tokens (none too),
    each into the front of a larger buffer whose tail must stay untouched.
``eager back-to-back``
    ``--calls`` all-gathers queued without any host synchronisation, the send
    buffer rewritten in place on the stream before each and every verified
    result copied aside on the stream: ranks drift apart on the device, which
    double buffering must survive.
``graph replay``
    one all-gather captured in a CUDA/HIP graph, replayed ``--replays`` times
    with the send buffer rewritten in place before each replay; every
    ``--verify-every``-th result (and the last) verified; the device epoch
    must equal the number of calls made. ``--skew-us`` makes the last rank
    pause now and then so the others really wait.
``timeout and poison``
    with a short timeout only rank 0 calls: its wait must give up (no hang)
    and ``check()`` must say so; its next call poisons the peers, whose
    ``check()`` must report rank 0.
``exchange graph``
    ``CandidateExchange(transport="ipc")`` on a decode workload, fused (two
    kernels) and as separate steps: an eager call, an eager call with fewer
    tokens through the same transport, and a captured exchange replayed back
    to back with the scores switched in place between two workloads (every
    result copied aside on the stream) all equal the unsharded oracle.
``nccl self``
    (CuPy with NCCL only) ``NCCLAllGather`` on one-rank communicators (one per
    process, so ranks sharing a GPU are fine): setup, eager, capture, replays.
``nccl world`` (``--nccl-world``)
    the same on the whole communicator (one GPU per rank).

Under the simulator the same checks run on the CPU (IPC on host shared
memory, "graphs" replayed eagerly, smaller defaults).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import numba_cp
from numba_cp import reference as ref
from numba_cp.arrays import device_copy, host_copy
from numba_cp.backend import TARGET, cuda
from numba_cp.comm import IPCAllGather, NCCLAllGather, choose_transport
from numba_cp.comm.nccl import nccl_module
from numba_cp.errors import IPCTimeoutError

SIM = TARGET.simulator


# ---------------------------------------------------------------------------
# Device helpers: CuPy on a GPU, the simulator's arrays on the CPU


class Device:
    def __init__(self):
        if not SIM:
            import cupy

            self.cp = cupy

    def put(self, host):
        return device_copy(np.ascontiguousarray(host), simulated_device=True)

    def get(self, array):
        return host_copy(array)

    def stream(self):
        return 0 if SIM else self.cp.cuda.Stream(non_blocking=True)

    def sync(self, stream):
        """Wait for ``stream``, or for the whole device when it is None."""
        if SIM:
            return
        if stream is None:
            self.cp.cuda.Device().synchronize()
        else:
            stream.synchronize()

    def copy(self, dst, src, stream):
        """``dst[...] = src`` on ``stream`` (device to device, not waited for)."""
        if SIM:
            np.asarray(dst)[...] = np.asarray(src)
        else:
            with stream:
                dst[...] = src

    def add(self, dst, src, value, stream):
        """``dst[...] = src + value`` on ``stream``."""
        if SIM:
            np.add(np.asarray(src), np.asarray(value, dtype=np.asarray(src).dtype),
                   out=np.asarray(dst))
        else:
            with stream:
                self.cp.add(src, src.dtype.type(value), out=dst)

    def capture(self, work, stream):
        """Record ``work(stream)`` once (after one eager run); returns ``replay()``."""
        from numba_cp.exchange import record_graph

        replay = record_graph(work, stream)
        return lambda: replay(stream)


DEV = Device()


# ---------------------------------------------------------------------------
# Payloads


def payload(rank, round_, shape, dtype):
    """Rank- and round-specific bytes of ``shape``/``dtype`` (no NaN, all bits used)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.int64:
        values = (np.arange(n, dtype=np.int64) * 1_000_003 + rank * 10**12 + round_ * 7 + 1)
        values[::5] = -values[::5]
        if n:
            values[rank % n] = np.iinfo(np.int64).max - rank
        return values.reshape(shape)
    if dtype == np.float16:
        return ((np.arange(n) - n / 2) * 0.25 + rank * 100 + round_ * 0.5).astype(
            np.float16).reshape(shape)
    rng = np.random.default_rng(1000 * rank + round_)
    return rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(
        shape)


def expected(world, round_, shape, dtype):
    return np.stack([payload(q, round_, shape, dtype) for q in range(world)])


def drift_base(rank, shape):
    """int64 payload that later calls add small counts to (no overflow)."""
    n = int(np.prod(shape, dtype=np.int64))
    values = np.arange(n, dtype=np.int64) * 1_000_003 + rank * 10**12 - 5 * 10**11
    values[1::3] = -values[1::3]
    return values.reshape(shape)


def bad_blocks(got, want):
    return [q for q in range(want.shape[0]) if got[q].tobytes() != want[q].tobytes()]


# ---------------------------------------------------------------------------
# Checks: each returns (ok, detail) on every rank; "skip" as ok=None


def check_choose(comm, args):
    transport = choose_transport(comm, device=True)
    # The simulator never picks IPC by itself (it is only emulated when forced).
    ok = (transport.name != "ipc") if SIM else (transport.name == "ipc")
    return ok, f"{transport.name}: {transport.reason}"


def check_eager(comm, args, shape, dtype, rounds=4):
    rank, world = comm.Get_rank(), comm.Get_size()
    stream = DEV.stream()
    problems = []
    t0 = time.perf_counter()
    with IPCAllGather(comm, timeout=args.timeout).setup(shape, dtype) as t:
        for round_ in range(rounds):
            send_host = payload(rank, round_, shape, dtype)
            send = DEV.put(send_host)
            nbytes = world * send_host.nbytes
            recv = DEV.put(np.full(nbytes, 0x5A, np.uint8).view(dtype).reshape(
                (world,) + tuple(shape)))
            t.all_gather(send, recv, stream=stream)
            DEV.sync(stream)
            got = DEV.get(recv)
            want = expected(world, round_, shape, dtype)
            if got.tobytes() != want.tobytes():
                problems.append(f"round {round_}: wrong blocks {bad_blocks(got, want)}")
            if DEV.get(send).tobytes() != send_host.tobytes():
                problems.append(f"round {round_}: send was modified")
        state = t.check()
        if state["epoch"] != rounds:
            problems.append(f"device epoch {state['epoch']} after {rounds} calls")
    elapsed = (time.perf_counter() - t0) / rounds * 1e6
    return not problems, "; ".join(problems) or f"{rounds} rounds, ~{elapsed:.0f} us/call"


def check_fewer_tokens(comm, args):
    rank, world = comm.Get_rank(), comm.Get_size()
    heads, most, topk = args.heads, args.tokens, args.topk
    stream = DEV.stream()
    problems = []
    counts = [most, max(most // 2, 1), 0, 1, most]
    with IPCAllGather(comm, timeout=args.timeout).setup((heads, most, topk),
                                                              np.int64) as t:
        for round_, tokens in enumerate(counts):
            shape = (heads, tokens, topk)
            mine = payload(rank, round_, shape, np.int64)
            send = DEV.put(np.concatenate([mine.reshape(-1), np.full(7, -1, np.int64)]))
            recv_whole = DEV.put(np.full(world * mine.size + 9, 0x5A5A, np.int64))
            recv = recv_whole[:world * mine.size].reshape((world,) + shape)
            t.all_gather(send[:mine.size].reshape(shape), recv, stream=stream)
            DEV.sync(stream)
            got = DEV.get(recv_whole)
            want = expected(world, round_, shape, np.int64)
            if got[:want.size].tobytes() != want.tobytes():
                problems.append(f"tokens {tokens}: wrong blocks "
                                f"{bad_blocks(got[:want.size].reshape(want.shape), want)}")
            if (got[want.size:] != 0x5A5A).any():
                problems.append(f"tokens {tokens}: wrote past recv")
        state = t.check()
        calls = sum(1 for n in counts if n)  # a call with nothing to move launches nothing
        if state["epoch"] != calls:
            problems.append(f"device epoch {state['epoch']} after {calls} calls")
    return not problems, "; ".join(problems) or f"tokens {counts} of at most {most}, exact"


def _drifting_calls(comm, args, calls, replay_factory, label):
    """Shared by the back-to-back and graph checks: in-place send updates, results aside."""
    rank, world = comm.Get_rank(), comm.Get_size()
    shape, dtype = (args.heads, args.tokens, args.topk), np.int64
    stream = DEV.stream()
    base_host = drift_base(rank, shape)
    base = DEV.put(base_host)
    send = DEV.put(base_host)
    recv = DEV.put(np.zeros((world,) + shape, dtype))
    verify_at = sorted(set(range(0, calls, args.verify_every)) | {calls - 1})
    history = DEV.put(np.zeros((len(verify_at), world) + shape, dtype))
    problems = []
    with IPCAllGather(comm, timeout=args.timeout).setup(shape, dtype) as t:
        replay, warmups = replay_factory(t, send, recv, stream)
        DEV.sync(stream)
        comm.Barrier()
        t0 = time.perf_counter()
        k = 0
        for i in range(calls):
            DEV.add(send, base, i + 1, stream)  # in place, on the stream: no host sync
            replay()
            if i == verify_at[k]:
                DEV.copy(history[k], recv, stream)
                k += 1
            if args.skew_us and rank == world - 1 and i % 97 == 0:
                time.sleep(args.skew_us * 1e-6)  # the others' waits really wait now
        DEV.sync(stream)
        elapsed = (time.perf_counter() - t0) / calls * 1e6
        got = DEV.get(history)
        base_all = np.stack([drift_base(q, shape) for q in range(world)])
        wrong = [i for k, i in enumerate(verify_at)
                 if not np.array_equal(got[k], base_all + (i + 1))]
        if wrong:
            problems.append(f"{len(wrong)}/{len(verify_at)} verified results wrong, first at "
                            f"call {wrong[0]}")
        try:
            state = t.check()
        except IPCTimeoutError as exc:
            problems.append(str(exc))
        else:
            if state["epoch"] != calls + warmups:
                problems.append(f"device epoch {state['epoch']} after {calls + warmups} calls")
    detail = (f"{calls} {label}, {len(verify_at)} verified, ~{elapsed:.1f} us/call "
              f"(payload {int(np.prod(shape)) * 8} B/rank)")
    return not problems, "; ".join(problems) or detail


def check_back_to_back(comm, args):
    def factory(t, send, recv, stream):
        return (lambda: t.all_gather(send, recv, stream=stream)), 0

    return _drifting_calls(comm, args, args.calls, factory, "eager calls")


def check_graph(comm, args):
    def factory(t, send, recv, stream):
        replay = DEV.capture(lambda s: t.all_gather(send, recv, stream=s), stream)
        return replay, (0 if SIM else 1)  # the eager run before the capture is a call too

    return _drifting_calls(comm, args, args.replays, factory, "graph replays")


def check_timeout(comm, args):
    rank, world = comm.Get_rank(), comm.Get_size()
    if world < 2:
        return None, "needs two ranks"
    shape = (16,)
    stream = DEV.stream()
    send = DEV.put(payload(rank, 0, shape, np.int64))
    recv = DEV.put(np.zeros((world,) + shape, np.int64))
    problems = []
    waited = 0.0
    t = IPCAllGather(comm, timeout=args.give_up_after).setup(shape, np.int64)
    try:
        if rank == 0:
            t0 = time.perf_counter()
            t.all_gather(send, recv, stream=stream)  # nobody else calls: must give up
            DEV.sync(stream)
            waited = time.perf_counter() - t0
            state = t.state()
            if state["error_epoch"] != 1 or state["error_peer"] != 1:
                problems.append(f"expected a timeout of call 1 waiting for rank 1, got {state}")
            t.all_gather(send, recv, stream=stream)  # poisons the peers, does not wait
            DEV.sync(stream)
        comm.Barrier()
        if rank != 0:
            t.all_gather(send, recv, stream=stream)
            DEV.sync(stream)
        try:
            t.check()
            problems.append("check() raised nothing")
        except IPCTimeoutError as exc:
            want = "gave up waiting for rank 1" if rank == 0 else "rank 0 gave up"
            if want not in str(exc):
                problems.append(f"check() said {exc!s}, expected {want!r}")
        comm.Barrier()
    finally:
        t.teardown()
    detail = f"timeout {args.give_up_after:g} s"
    if rank == 0 and not problems:
        detail += f", rank 0 gave up after {waited * 1e3:.1f} ms"
    return not problems, "; ".join(problems) or detail


def check_exchange(comm, args):
    from numba_cp.exchange import ExchangeConfig
    from numba_cp.workload import decode_workload

    rank, world = comm.Get_rank(), comm.Get_size()
    works = [decode_workload(heads=args.heads, batch=args.batch, query_len=1,
                             context=args.context, seed=seed) for seed in (11, 12)]
    fewer = decode_workload(heads=args.heads, batch=max(args.batch // 2, 1), query_len=1,
                            context=args.context, seed=13)
    # one seq_lens for both (the captured graph reads the same seq_lens buffer)
    seq_host = works[0].seq_lens
    config = ExchangeConfig(heads=args.heads, max_tokens=works[0].tokens, topk=args.topk,
                            world=world, global_blocks=works[0].global_blocks)
    window = dict(topk=args.topk, query_len=1, global_blocks=config.global_blocks,
                  init_blocks=config.init_blocks, local_blocks=config.local_blocks)
    shards = [DEV.put(ref.shard_scores(w.full_scores, rank=rank, world=world,
                                       global_blocks=w.global_blocks)) for w in works]
    oracle = [ref.global_topk(w.full_scores, seq_host, **window) for w in works]
    scores = DEV.put(DEV.get(shards[0]))
    seq_lens = DEV.put(seq_host)
    stream = DEV.stream()
    problems, details = [], []
    for fused in (True, False):
        elapsed, replays = _exchange_round(comm, config, fused, scores, seq_lens, shards,
                                           oracle, fewer, window, stream, args, problems)
        details.append(f"{'fused' if fused else 'separate'} ~{elapsed:.0f} us/replay")
    detail = (f"heads={args.heads} batch={args.batch} context={args.context} topk={args.topk}: "
              f"eager ({works[0].tokens} and {fewer.tokens} tokens) + {replays} replays exact, "
              + ", ".join(details))
    return not problems, "; ".join(problems) or detail


def _exchange_round(comm, config, fused, scores, seq_lens, shards, oracle, fewer, window,
                    stream, args, problems):
    from numba_cp.exchange import CandidateExchange

    rank, world = comm.Get_rank(), comm.Get_size()
    label = "fused" if fused else "separate"
    DEV.copy(scores, shards[0], stream)  # the previous round's replays left either workload
    DEV.sync(stream)
    with CandidateExchange(comm, config, transport="ipc", fused=fused) as plan:
        transport = plan.transport
        if transport.name != "ipc" or not plan.gather_is_capturable or plan.fused != fused:
            problems.append(f"plan uses {plan.describe()}, asked fused={fused}")
        DEV.sync(None)  # the uploads ran on the current stream; the plan runs on `stream`
        result = plan(scores, seq_lens, stream=stream)
        DEV.sync(stream)  # and the read-back is not ordered after `stream` either
        if not np.array_equal(DEV.get(result), oracle[0]):
            problems.append(f"{label}: eager exchange differs from the oracle")
        few_scores = DEV.put(ref.shard_scores(fewer.full_scores, rank=rank, world=world,
                                              global_blocks=fewer.global_blocks))
        few_seq = DEV.put(fewer.seq_lens)
        DEV.sync(None)
        result = plan(few_scores, few_seq, stream=stream)
        DEV.sync(stream)
        if plan.transport is not transport:
            problems.append(f"{label}: the plan changed its transport for fewer tokens")
        if not np.array_equal(DEV.get(result),
                              ref.global_topk(fewer.full_scores, fewer.seq_lens, **window)):
            problems.append(f"{label}: eager exchange of {fewer.tokens} tokens differs from "
                            "the oracle")
        captured = plan.capture(scores, seq_lens, stream=stream)
        replays = max(4, args.replays // 50)
        history = DEV.put(np.zeros((replays,) + oracle[0].shape, np.int32))
        t0 = time.perf_counter()
        for i in range(replays):
            DEV.copy(scores, shards[i % 2], stream)
            out = captured.replay()
            DEV.copy(history[i], out, stream)
        DEV.sync(stream)
        elapsed = (time.perf_counter() - t0) / replays * 1e6
        got = DEV.get(history)
        wrong = [i for i in range(replays) if not np.array_equal(got[i], oracle[i % 2])]
        if wrong:
            problems.append(f"{label}: replays {wrong[:8]} differ from the oracle")
        try:
            plan.check()
        except IPCTimeoutError as exc:
            problems.append(f"{label}: {exc}")
    return elapsed, replays


def _nccl_round_trip(comm, args, label):
    try:
        nccl_module()
    except Exception as exc:
        return None, f"no NCCL ({type(exc).__name__}: {exc})"
    rank, world = comm.Get_rank(), comm.Get_size()
    shape, dtype = (args.heads, args.tokens, args.topk), np.int64
    stream = DEV.stream()
    problems = []
    with NCCLAllGather(comm).setup(shape, dtype) as t:
        send = DEV.put(payload(rank, 0, shape, dtype))
        recv = DEV.put(np.zeros((world,) + shape, dtype))
        t.all_gather(send, recv, stream=stream)
        DEV.sync(stream)
        if DEV.get(recv).tobytes() != expected(world, 0, shape, dtype).tobytes():
            problems.append("eager all-gather wrong")
        base = DEV.put(drift_base(rank, shape))
        DEV.copy(send, base, stream)
        replay = DEV.capture(lambda s: t.all_gather(send, recv, stream=s), stream)
        for i in range(20):
            DEV.add(send, base, i + 1, stream)
            replay()
        DEV.sync(stream)
        if not np.array_equal(DEV.get(recv),
                              np.stack([drift_base(q, shape) for q in range(world)]) + 20):
            problems.append("graph replays wrong")
    return not problems, "; ".join(problems) or f"{label}: eager + capture + 20 replays exact"


def check_nccl_self(comm, args):
    single = comm.Split(comm.Get_rank(), 0)
    try:
        return _nccl_round_trip(single, args, "one-rank communicators")
    finally:
        single.Free()


def check_nccl_world(comm, args):
    return _nccl_round_trip(comm, args, f"{comm.Get_size()} ranks")


# ---------------------------------------------------------------------------
# Driver


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replays", type=int, default=12 if SIM else 1000)
    p.add_argument("--verify-every", type=int, default=4 if SIM else 50)
    p.add_argument("--calls", type=int, default=8 if SIM else 200,
                   help="back-to-back eager calls")
    p.add_argument("--heads", type=int, default=2 if SIM else 4)
    p.add_argument("--tokens", type=int, default=3 if SIM else 64)
    p.add_argument("--topk", type=int, default=8 if SIM else 16)
    p.add_argument("--batch", type=int, default=3 if SIM else 64)
    p.add_argument("--context", type=int, default=4096 if SIM else 131072)
    p.add_argument("--skew-us", type=float, default=0 if SIM else 200,
                   help="the last rank sleeps this long every 97 calls")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before an IPC wait gives up, for the checks' transports "
                        "(default: NUMBA_CP_IPC_TIMEOUT or numba_cp.comm.ipc.DEFAULT_TIMEOUT_S)")
    p.add_argument("--give-up-after", type=float, default=0.5 if SIM else 0.05,
                   help="the IPC timeout, in seconds, of the timeout check")
    p.add_argument("--nccl-world", action="store_true",
                   help="also NCCL over the whole communicator (one GPU per rank)")
    p.add_argument("--only", default=None, help="comma-separated check name prefixes")
    return p.parse_args(argv)


def bind_device(comm):
    if SIM:
        return "cpu (simulator)"
    import cupy

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = local.Get_rank() % cupy.cuda.runtime.getDeviceCount()
    local.Free()
    cupy.cuda.Device(device).use()
    cuda.select_device(device)
    return f"gpu{device} {numba_cp.backend.describe()}"


def checks(args):
    found = [("choose", check_choose)]
    for name, shape, dtype in (("eager int64 keys", (args.heads, args.tokens, args.topk),
                                np.int64),
                               ("eager float16", (2, 3, 4), np.float16),
                               ("eager uint8 odd bytes", (5, 7), np.uint8),
                               ("eager int64 tiny", (3,), np.int64)):
        found.append((name, lambda c, a, s=shape, d=dtype: check_eager(c, a, s, d)))
    found += [("eager fewer tokens", check_fewer_tokens),
              ("eager back-to-back", check_back_to_back), ("graph replay", check_graph),
              ("timeout and poison", check_timeout), ("exchange graph", check_exchange),
              ("nccl self", check_nccl_self)]
    if args.nccl_world:
        found.append(("nccl world", check_nccl_world))
    if args.only:
        prefixes = [p.strip() for p in args.only.split(",")]
        found = [(n, f) for n, f in found if any(n.startswith(p) for p in prefixes)]
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    where = comm.gather(f"rank {rank}: {MPI.Get_processor_name()} {bind_device(comm)}", root=0)
    if rank == 0:
        print(f"ipc_device_check | numba_cp {numba_cp.__version__} | backend {TARGET.name} "
              f"| world {world} | MPI {MPI.Get_library_version().splitlines()[0].strip()}")
        for line in where:
            print(f"      {line}")
        sys.stdout.flush()
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name, check in checks(args):
        try:
            ok, detail = check(comm, args)
        except Exception as exc:  # reported like a failure; the next check still runs
            ok, detail = False, f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        reports = comm.gather((ok, detail), root=0)
        if rank == 0:
            if any(o is False for o, _ in reports):
                verdict = "FAIL"
                by_detail = {}
                for r, (o, d) in enumerate(reports):
                    if o is False:
                        by_detail.setdefault(d, []).append(str(r))
                detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(rs)}: {d}"
                                   for d, rs in by_detail.items())
            elif all(o is None for o, _ in reports):
                verdict, detail = "SKIP", reports[0][1]
            else:
                verdict, detail = "PASS", reports[0][1]
            counts[verdict] += 1
            print(f"{verdict}  {name}  {detail}", flush=True)
    status = 1 if comm.bcast(counts["FAIL"] if rank == 0 else None, root=0) else 0
    if rank == 0:
        print(f"ipc_device_check: {counts['PASS']} passed, {counts['FAIL']} failed, "
              f"{counts['SKIP']} skipped (world {world})", flush=True)
    return status


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2)
        os._exit(2)
    sys.exit(code)
