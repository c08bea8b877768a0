"""One rank fails at one stage of the exchange; every rank must end, and say how.

Run under mpiexec by tests/comm/test_faults.py: ``fault_scenarios.py SCENARIO``.
Each rank prints one line, ``rank R: OUTCOME`` (``ok``, or the exception's
type and message), and exits 0; the test asserts the outcomes and that the
whole job ended within its time limit (no rank left hanging).
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from numba_cp import reference as ref
from numba_cp.exchange import CandidateExchange, ExchangeConfig

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
GLOBAL_BLOCKS, TOKENS = 24, 4


def config(**changes):
    fields = dict(heads=2, max_tokens=8, topk=4, world=world, global_blocks=GLOBAL_BLOCKS)
    fields.update(changes)
    return ExchangeConfig(**fields)


def inputs(tokens=TOKENS, dtype=np.float32):
    rng = np.random.default_rng(7)
    full = rng.standard_normal((2, tokens, GLOBAL_BLOCKS)).astype(np.float32)
    seq_lens = np.full(tokens, GLOBAL_BLOCKS * 128, np.int32)
    shard = ref.shard_scores(full, rank=rank, world=world, global_blocks=GLOBAL_BLOCKS)
    return np.ascontiguousarray(shard, dtype=dtype), seq_lens, full


def exact(plan, tokens=TOKENS):
    scores, seq_lens, full = inputs(tokens)
    got = np.asarray(plan(scores, seq_lens))
    want = ref.global_topk(full, seq_lens, topk=4, global_blocks=GLOBAL_BLOCKS, query_len=1,
                           init_blocks=1, local_blocks=2)
    assert (got == want).all()


def config_mismatch():
    CandidateExchange(comm, config(topk=8 if rank == 1 else 4))


def config_local_failure():
    CandidateExchange(comm, config(), transport="nonesuch" if rank == 1 else None)


def transport_mismatch():
    CandidateExchange(comm, config(), transport="ipc" if rank == 0 else None)


def first_call_bad_dtype():
    with CandidateExchange(comm, config()) as plan:
        scores, seq_lens, _ = inputs(dtype=np.float64 if rank == 1 else np.float32)
        plan(scores, seq_lens)


def later_call_tokens():
    with CandidateExchange(comm, config()) as plan:
        exact(plan)
        exact(plan, tokens=2 if rank == 1 else TOKENS)


def extra_call():
    with CandidateExchange(comm, config()) as plan:
        exact(plan)
        if rank == 0:
            exact(plan)


def ipc_peer_gone():
    with CandidateExchange(comm, config(), transport="ipc") as plan:
        exact(plan)
        if rank == 0:
            scores, seq_lens, _ = inputs()
            plan(scores, seq_lens)  # its peers never come: the wait gives up
            plan(scores, seq_lens)  # ... and this call refuses
        else:
            time.sleep(1)


def nodes_mismatch():
    """Ranks told different pretend nodes (NUMBA_CP_NODES) for a two-level exchange."""
    os.environ["NUMBA_CP_NODES"] = "2" if rank == 1 else "1"
    with CandidateExchange(comm, config(hierarchy="node")) as plan:
        exact(plan)


def nodes_bad_value():
    os.environ["NUMBA_CP_NODES"] = "0" if rank == 0 else "1"
    with CandidateExchange(comm, config(hierarchy="node")) as plan:
        exact(plan)


def two_levels_exact():
    os.environ["NUMBA_CP_NODES"] = "2"
    with CandidateExchange(comm, config(hierarchy="node")) as plan:
        exact(plan)
        exact(plan, tokens=2)


def config_type_uncaught():
    """Run under ``python -m mpi4py`` without the handler below: one rank's bad field
    raises before the plan exists, and mpi4py's handler must abort the job."""
    heads = True if rank == 1 else 2
    CandidateExchange(comm, config(heads=heads))
    time.sleep(600)  # the other ranks: wait for the abort


SCENARIOS = {f.__name__: f for f in (config_mismatch, config_local_failure, transport_mismatch,
                                      first_call_bad_dtype, later_call_tokens, extra_call,
                                      ipc_peer_gone, nodes_mismatch, nodes_bad_value,
                                      two_levels_exact)}

if __name__ == "__main__" and sys.argv[1] == "config_type_uncaught":
    config_type_uncaught()
elif __name__ == "__main__":
    start = time.monotonic()
    try:
        SCENARIOS[sys.argv[1]]()
        outcome = "ok"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    print(f"\nrank {rank}: {outcome} ({time.monotonic() - start:.1f} s)", flush=True)
    # A rank that exits ends the job, so wait (bounded, through files: a peer may be
    # stuck in a collective) until every rank has reported; then exit without
    # finalizing MPI, which would wait for the stuck collectives.
    done = os.environ.get("FAULT_DIR")
    if done:
        open(os.path.join(done, str(rank)), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(done)) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)
