"""Run under mpiexec by tests/comm/test_mpi_jobs.py: the transports end to end.

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
    :func:`~numba_cp.comm.choose_transport` with ``device=True``/``False``)
    and each dtype (int64 keys, float16, uint16 as a bf16 view), set up once
    and all-gather two rounds of rank-specific data; ``recv`` must equal every
    rank's send, byte for byte.
``tokens``
    For each transport, set up once for the largest payload and gather sends
    of fewer tokens (none too), in 8-byte words and in bytes, each into the
    front of a larger buffer whose tail must stay untouched; then a send
    larger than the setup must raise ValueError naming ``send`` on every rank.
``mismatch``
    Rank 1 (and every odd rank) sets up a different shape (``--what shape``) or
    dtype (``--what dtype``); every rank must get the same ValueError from setup.
``choose``
    Only call ``choose_transport`` (for the unknown-name error).

``--fake-nccl`` hands the ``nccl`` transport ``fake_nccl.py`` (NCCL over MPI
on host memory) as its module, so it runs under the simulator.
``--ipc-probe RANKS`` makes the IPC probe of ``auto`` answer yes on the listed
ranks (``all``, ``none`` or ``0,2``), with GPU-identity and peer-access probes
that agree, so ``auto`` exercises the collective IPC choice; the simulator
then runs the chosen ``ipc`` transport on host shared memory.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from numba_cp.backend import cuda
from numba_cp.comm import TRANSPORTS, NCCLAllGather, Probes, choose_transport
from rank_lines import begin, say

SHAPE = (2, 3, 4)  # heads, tokens, topk
SENTINEL = 0xA5
# (dtype, largest shape, token counts in call order): int64 keys in 8-byte words,
# and a uint8 payload of 9 bytes per token that moves in words (8 tokens) or bytes.
TOKEN_PLANS = (("int64", (2, 5, 4), (5, 2, 0, 1, 5, 3)),
               ("uint8", (3, 8, 3), (8, 3, 0, 8, 1, 5)))




def int64_keys(rank, round_, shape=SHAPE):
    n = int(np.prod(shape))
    keys = np.arange(n, dtype=np.int64) * 1_000_003 + rank * 10**12 + round_ * 7 + 1
    keys[::5] = -keys[::5]
    if n:
        keys[rank % n] = np.iinfo(np.int64).max - rank
        keys[(rank + 1) % n] = np.iinfo(np.int64).min + round_
    return keys.reshape(shape)


def float16_values(rank, round_, shape=SHAPE):
    n = int(np.prod(shape))
    values = ((np.arange(n) - n / 2) * 0.25 + rank * 100 + round_ * 0.5).astype(np.float16)
    specials = np.array([np.inf, -np.inf, -0.0, 2.0**-24, 65504.0], dtype=np.float16)
    values[(rank + np.arange(len(specials))) % n] = specials
    return values.reshape(shape)


def bf16_bits(rank, round_, shape=SHAPE):
    n = int(np.prod(shape))
    f32 = (np.arange(n, dtype=np.float32) - 7.5) * np.float32(1.5 + rank) + np.float32(round_)
    f32[rank % n] = np.float32(-3.0e38)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).reshape(shape)


def bytes_of(rank, round_, shape):
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.int64) * 13 + rank * 71 + round_ * 29 + 3) % 256).astype(
        np.uint8).reshape(shape)


MAKERS = {"int64": int64_keys, "float16": float16_values, "uint16": bf16_bits}
TOKEN_MAKERS = {"int64": int64_keys, "uint8": bytes_of}


def stand_in_probes(args, comm):
    """The IPC answers ``--ipc-probe`` asks for; the real probes otherwise."""
    if args.ipc_probe is None:
        return Probes()
    rank = comm.Get_rank()
    spec = args.ipc_probe.strip()
    yes = (set(range(comm.Get_size())) if spec == "all" else set() if spec == "none"
           else {int(r) for r in spec.split(",")})
    return Probes(ipc_local=lambda: ((True, "stand-in probe") if rank in yes else
                                     (False, f"stand-in probe says no on rank {rank}")),
                  gpu_identity=lambda: "sim-gpu",
                  peer_access=lambda identities: (True, "stand-in peer access"))


def make_transport(kind, comm, args):
    if kind == "auto":
        return choose_transport(comm, device=True, probes=stand_in_probes(args, comm))
    if kind == "auto-host":
        return choose_transport(comm, device=False)
    if kind == "nccl" and args.fake_nccl:
        import fake_nccl  # a sibling of this script

        fake_nccl.reset(comm)
        return NCCLAllGather(comm, module=fake_nccl)
    return TRANSPORTS[kind](comm)


def _place(transport, host):
    return cuda.to_device(host) if transport.device else host.copy()


def _fetch(array):
    return array.copy_to_host() if hasattr(array, "copy_to_host") else np.array(array)


def gather_once(transport, maker, rank, size, round_):
    """One all-gather; returns (gathered host array, expected array, send unchanged)."""
    send_host = maker(rank, round_)
    dtype = send_host.dtype
    recv_shape = (size,) + SHAPE
    nbytes = int(np.prod(recv_shape)) * dtype.itemsize
    fill = np.full(nbytes, SENTINEL, np.uint8).view(dtype).reshape(recv_shape)
    send, recv = _place(transport, send_host), _place(transport, fill)
    out = transport.all_gather(send, recv, stream=cuda.stream() if transport.device else None)
    assert out is recv, f"all_gather returned {type(out).__name__}, not recv"
    expected = np.stack([maker(r, round_) for r in range(size)])
    return _fetch(recv), expected, _fetch(send).tobytes() == send_host.tobytes()


def case_values(args, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = 0
    for kind in args.transports.split(","):
        transport = make_transport(kind, comm, args)
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


def _front(transport, shape, dtype, spare):
    """``shape`` at the front of a sentinel-filled buffer ``spare`` elements longer."""
    count = int(np.prod(shape))
    host = np.full((count + spare) * np.dtype(dtype).itemsize, SENTINEL, np.uint8).view(dtype)
    whole = _place(transport, host)
    return whole[:count].reshape(shape), whole


def case_tokens(args, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = 0
    for kind in args.transports.split(","):
        transport = make_transport(kind, comm, args)
        for dtype_name, most, token_counts in TOKEN_PLANS:
            maker = TOKEN_MAKERS[dtype_name]
            with transport.setup(most, np.dtype(dtype_name)):
                for round_, tokens in enumerate(token_counts):
                    shape = (most[0], tokens, most[2])
                    send, _ = _front(transport, shape, dtype_name, spare=5)
                    mine = maker(rank, round_, shape)
                    if transport.device:
                        send.copy_to_device(np.ascontiguousarray(mine))
                    else:
                        send[...] = mine
                    recv, whole = _front(transport, (size,) + shape, dtype_name, spare=11)
                    transport.all_gather(send, recv,
                                         stream=cuda.stream() if transport.device else None)
                    got = _fetch(whole)
                    want = np.stack([maker(r, round_, shape) for r in range(size)])
                    label = (f"transport={transport.name} asked={kind} dtype={dtype_name} "
                             f"tokens={tokens} round={round_}")
                    tail_ok = bool((got[want.size:].view(np.uint8) == SENTINEL).all())
                    exact = got[:want.size].tobytes() == want.tobytes()
                    if exact and tail_ok:
                        say(rank, f"OK {label}")
                    else:
                        failures += 1
                        say(rank, f"FAIL {label} exact={exact} tail_untouched={tail_ok}")
                over = (most[0], most[1] + 1, most[2])
                try:
                    transport.all_gather(_place(transport, maker(rank, 0, over)),
                                         _place(transport, np.zeros((size,) + over, dtype_name)))
                except ValueError as exc:
                    if str(exc).startswith("send: "):
                        say(rank, f"OK transport={transport.name} asked={kind} dtype={dtype_name} "
                                  f"rejects tokens={over[1]}")
                    else:
                        failures += 1
                        say(rank, f"FAIL oversize send: {exc}")
                else:
                    failures += 1
                    say(rank, f"FAIL transport={transport.name} gathered {over[1]} tokens "
                              f"after a setup for {most[1]}")
    return 1 if failures else 0


def case_mismatch(args, comm):
    rank = comm.Get_rank()
    shape, dtype = SHAPE, np.dtype(np.int64)
    if rank % 2 == 1:
        if args.what == "shape":
            shape = (SHAPE[0], SHAPE[1] + 1, SHAPE[2])
        else:
            dtype = np.dtype(np.float16)
    transport = make_transport(args.transports.split(",")[0], comm, args)
    try:
        transport.setup(shape, dtype)
    except ValueError as exc:
        say(rank, f"ERROR {type(exc).__name__}: {exc}")
        return 2
    say(rank, f"FAIL setup accepted shape={shape} dtype={dtype}")
    return 1


def case_choose(args, comm):
    rank = comm.Get_rank()
    try:
        transport = choose_transport(comm, device=args.device == 1,
                                     probes=stand_in_probes(args, comm))
    except ValueError as exc:
        say(rank, f"ERROR ValueError: {exc}")
        return 2
    say(rank, f"OK transport={transport.name} reason={transport.reason}")
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True, help="the world size expected")
    parser.add_argument("--case", choices=("values", "tokens", "mismatch", "choose"),
                        default="values")
    parser.add_argument("--transports", default="host,staged,mpi-device")
    parser.add_argument("--what", choices=("shape", "dtype"), default="shape")
    parser.add_argument("--device", type=int, choices=(0, 1), default=1)
    parser.add_argument("--out-dir", help="also write each rank's lines to a file here")
    parser.add_argument("--fake-nccl", action="store_true")
    parser.add_argument("--ipc-probe", default=None)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, ok = begin(comm, args.out_dir, args.size)
    if not ok:
        return 3
    cases = {"values": case_values, "tokens": case_tokens, "mismatch": case_mismatch,
             "choose": case_choose}
    try:
        code = cases[args.case](args, comm)
    except Exception as exc:  # an unexpected error: take the job down rather than hang
        say(rank, f"ERROR {type(exc).__name__}: {exc}")
        sys.stdout.flush()
        comm.Abort(4)
        return 4
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
