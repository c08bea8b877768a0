"""Exceptions with a meaning beyond their type."""


class RankAgreementError(ValueError):
    """The ranks of a communicator disagree; raised identically on every rank.

    Since no rank is left waiting in a collective, a driver may let each rank
    report it and exit normally instead of aborting the job.
    """


class IPCTimeoutError(RuntimeError):
    """An IPC all-gather gave up waiting for a peer; what it gathered since is garbage."""
