"""Run under mpiexec by tests/test_transport.py: checks numba_cp.transport end to end.

Every rank prints ``rank=R size=N`` first, then one line per check it made:
``rank=R OK ...``, ``rank=R FAIL ...`` or ``rank=R ERROR <Type>: <message>``;
with ``--out-dir`` it writes the same lines to a file of its own there too
(``rank<R>-pid<PID>.txt``), since mpiexec may interleave the ranks' stdout.
Exit status: 0 all checks passed; 1 a check failed; 2 an expected error was
raised (the mismatch and unknown-transport cases); 3 the world size is not the
one expected (a launcher/library mismatch runs N singletons of size 1).

Cases:

``values``
    For each transport in ``--transports`` (``host``, ``staged``,
    ``mpi-device``, ``ipc``, ``nccl``, or ``auto``/``auto-host`` for
    :func:`choose_transport` with
    ``device=True``/``False``) and each dtype (int64 keys, float16, uint16 as a
    bf16 view), set up once and all-gather two rounds of rank-specific data;
    ``recv`` must equal every rank's send, byte for byte.
``mismatch``
    Rank 1 (and every odd rank) sets up a different shape (``--what shape``) or
    dtype (``--what dtype``); every rank must get the same ValueError from setup.
``choose``
    Only call ``choose_transport`` (for the unknown-name error).

``--fake-nccl`` replaces ``cupy.cuda.nccl`` by ``fake_nccl.py`` (NCCL over MPI
on host memory), so the ``nccl`` transport runs under the simulator.
``--ipc-probe RANKS`` makes :func:`numba_cp.transport.ipc_probe` answer yes on
the listed ranks (``all``, ``none`` or ``0,2``) and the GPU-identity and
peer-access probes agree, so ``auto`` exercises the collective IPC choice;
the simulator then runs the chosen ``ipc`` transport on host shared memory.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numba_cp import transport as T  # noqa: E402
from numba_cp.backend import cuda  # noqa: E402

SHAPE = (2, 3, 4)  # heads, tokens, topk
SENTINEL = 0xA5


LOG = None  # this rank's own file under --out-dir: mpiexec may interleave stdout lines


def say(rank, text):
    line = f"rank={rank} {text}\n"
    sys.stdout.write(line)  # one write per line
    sys.stdout.flush()
    if LOG is not None:
        LOG.write(line)
        LOG.flush()


def int64_keys(rank, round_):
    n = int(np.prod(SHAPE))
    keys = np.arange(n, dtype=np.int64) * 1_000_003 + rank * 10**12 + round_ * 7 + 1
    keys[::5] = -keys[::5]
    keys[rank % n] = np.iinfo(np.int64).max - rank
    keys[(rank + 1) % n] = np.iinfo(np.int64).min + round_
    return keys.reshape(SHAPE)


def float16_values(rank, round_):
    n = int(np.prod(SHAPE))
    values = ((np.arange(n) - n / 2) * 0.25 + rank * 100 + round_ * 0.5).astype(np.float16)
    specials = np.array([np.inf, -np.inf, -0.0, 2.0**-24, 65504.0], dtype=np.float16)
    values[(rank + np.arange(len(specials))) % n] = specials
    return values.reshape(SHAPE)


def bf16_bits(rank, round_):
    n = int(np.prod(SHAPE))
    f32 = (np.arange(n, dtype=np.float32) - 7.5) * np.float32(1.5 + rank) + np.float32(round_)
    f32[rank % n] = np.float32(-3.0e38)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).reshape(SHAPE)


MAKERS = {"int64": int64_keys, "float16": float16_values, "uint16": bf16_bits}


def make_transport(kind, comm):
    if kind == "auto":
        return T.choose_transport(comm, device=True)
    if kind == "auto-host":
        return T.choose_transport(comm, device=False)
    return T.TRANSPORTS[kind](comm)


def gather_once(transport, maker, rank, size, round_):
    """One all-gather; returns (gathered host array, expected array, send unchanged)."""
    send_host = maker(rank, round_)
    dtype = send_host.dtype
    recv_shape = (size,) + SHAPE
    nbytes = int(np.prod(recv_shape)) * dtype.itemsize
    fill = np.full(nbytes, SENTINEL, np.uint8).view(dtype).reshape(recv_shape)
    if transport.device:
        send = cuda.to_device(send_host)
        recv = cuda.to_device(fill)
        out = transport.all_gather(send, recv, stream=cuda.stream())
        got = recv.copy_to_host()
        send_after = send.copy_to_host()
    else:
        send = send_host.copy()
        recv = fill.copy()
        out = transport.all_gather(send, recv)
        got = recv
        send_after = send
    assert out is recv, f"all_gather returned {type(out).__name__}, not recv"
    expected = np.stack([maker(r, round_) for r in range(size)])
    return got, expected, send_after.tobytes() == send_host.tobytes()


def case_values(args, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = 0
    for kind in args.transports.split(","):
        transport = make_transport(kind, comm)
        for dtype_name, maker in MAKERS.items():
            with transport.setup(SHAPE, np.dtype(dtype_name)):
                for round_ in range(2):
                    got, expected, send_ok = gather_once(transport, maker, rank, size, round_)
                    same = got.shape == expected.shape and got.tobytes() == expected.tobytes()
                    label = (f"transport={transport.name} asked={kind} dtype={dtype_name} "
                             f"round={round_}")
                    if same and send_ok:
                        say(rank, f"OK {label}")
                    else:
                        failures += 1
                        bad = [r for r in range(size) if got[r].tobytes() != expected[r].tobytes()]
                        say(rank, f"FAIL {label} wrong_blocks={bad} send_unchanged={send_ok}")
            if transport.is_setup:
                failures += 1
                say(rank, f"FAIL transport={transport.name} still set up after the with block")
    return 1 if failures else 0


def case_mismatch(args, comm):
    rank = comm.Get_rank()
    shape, dtype = SHAPE, np.dtype(np.int64)
    if rank % 2 == 1:
        if args.what == "shape":
            shape = (SHAPE[0], SHAPE[1] + 1, SHAPE[2])
        else:
            dtype = np.dtype(np.float16)
    transport = make_transport(args.transports.split(",")[0], comm)
    try:
        transport.setup(shape, dtype)
    except ValueError as exc:
        say(rank, f"ERROR ValueError: {exc}")
        return 2
    say(rank, f"FAIL setup accepted shape={shape} dtype={dtype}")
    return 1


def case_choose(args, comm):
    rank = comm.Get_rank()
    try:
        transport = T.choose_transport(comm, device=args.device == 1)
    except ValueError as exc:
        say(rank, f"ERROR ValueError: {exc}")
        return 2
    say(rank, f"OK transport={transport.name} reason={transport.reason}")
    return 0


def patch_probes(args, comm):
    rank = comm.Get_rank()
    if args.fake_nccl:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import fake_nccl

        fake_nccl.reset(comm)
        T._nccl_module = lambda: fake_nccl
    if args.ipc_probe is not None:
        spec = args.ipc_probe.strip()
        yes = (set(range(comm.Get_size())) if spec == "all" else set() if spec == "none"
               else {int(r) for r in spec.split(",")})
        T.ipc_probe = lambda: ((True, "patched probe") if rank in yes else
                               (False, f"patched off on rank {rank}"))
        T._gpu_identity = lambda: "sim-gpu"
        T._peer_access = lambda identities: (True, "patched peer access")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True, help="the world size expected")
    parser.add_argument("--case", choices=("values", "mismatch", "choose"), default="values")
    parser.add_argument("--transports", default="host,staged,mpi-device")
    parser.add_argument("--what", choices=("shape", "dtype"), default="shape")
    parser.add_argument("--device", type=int, choices=(0, 1), default=1)
    parser.add_argument("--out-dir", help="also write each rank's lines to a file here")
    parser.add_argument("--fake-nccl", action="store_true")
    parser.add_argument("--ipc-probe", default=None)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    patch_probes(args, comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.out_dir:
        global LOG
        # a launcher/library mismatch runs N singletons, all rank 0: don't clobber
        LOG = open(os.path.join(args.out_dir, f"rank{rank}-pid{os.getpid()}.txt"), "w")
    say(rank, f"size={size}")
    if size != args.size:
        say(rank, f"FAIL size={size} but {args.size} ranks were launched: the mpiexec does "
                  "not match the MPI library mpi4py loaded")
        return 3
    try:
        code = {"values": case_values, "mismatch": case_mismatch, "choose": case_choose}[
            args.case](args, comm)
    except Exception as exc:  # an unexpected error: take the job down rather than hang
        say(rank, f"ERROR {type(exc).__name__}: {exc}")
        sys.stdout.flush()
        comm.Abort(4)
        return 4
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
