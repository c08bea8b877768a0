"""What the MPI check scripts share: one line per event, on stdout and in a per-rank file.

mpiexec may interleave the ranks' stdout lines, so with ``--out-dir`` each rank also
writes its own file, which the tests read.
"""

import os
import sys

_LOG = None


def say(rank, text):
    line = f"rank={rank} {text}\n"
    sys.stdout.write(line)  # one write per line
    sys.stdout.flush()
    if _LOG is not None:
        _LOG.write(line)
        _LOG.flush()


def begin(comm, out_dir, expected_size):
    """Open this rank's file and check the launcher matches mpi4py's MPI; ``(rank, ok)``."""
    global _LOG
    rank, size = comm.Get_rank(), comm.Get_size()
    if out_dir:
        # a launcher/library mismatch runs N singletons, all rank 0: don't clobber
        _LOG = open(os.path.join(out_dir, f"rank{rank}-pid{os.getpid()}.txt"), "w")
    say(rank, f"size={size}")
    if size != expected_size:
        say(rank, f"FAIL size={size} but {expected_size} ranks were launched: the mpiexec "
                  "does not match the MPI library mpi4py loaded")
        return rank, False
    return rank, True
