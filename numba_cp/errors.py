"""Exceptions with a meaning beyond their type."""


class RankAgreementError(ValueError):
    """The ranks of a communicator disagree; raised identically on every rank.

    Since no rank is left waiting in a collective, a driver may let each rank
    report it and exit normally instead of aborting the job.
    """


class IPCTimeoutError(RuntimeError):
    """An IPC all-gather gave up waiting for a peer; what it gathered since is garbage."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time: some rank is not taking part.

    A rank that failed (or made a call fewer or more than its peers) leaves the
    others waiting; the wait is bounded (``NUMBA_CP_TIMEOUT`` seconds), so they
    raise this instead of hanging. Under an MPI launcher the job then aborts.
    """
