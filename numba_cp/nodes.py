"""Which node each rank is on, for the two-level exchange.

Nodes come from ``MPI.COMM_TYPE_SHARED`` (ranks that share memory), unless
``NUMBA_CP_NODES`` says otherwise, so that one machine can stand in for
several nodes: a count ``N`` splits the ranks, in rank order, into ``N``
nodes as even as possible (the first ``world % N`` one rank larger), and a
list such as ``3,1,4`` gives each node's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .comm.base import allgather_objects

__all__ = ["NODES_ENV", "NodeLayout", "pretend_sizes", "sizes_from_env", "node_layout"]

NODES_ENV = "NUMBA_CP_NODES"


@dataclass(frozen=True)
class NodeLayout:
    """``node_of[r]``: the node of world rank ``r`` (nodes numbered by their lowest rank)."""

    node_of: tuple

    @property
    def nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def leaders(self) -> list:
        """Each node's lowest world rank, in node order."""
        return [self.node_of.index(n) for n in range(self.nodes)]

    def sizes(self) -> list:
        return [self.node_of.count(n) for n in range(self.nodes)]


def pretend_sizes(setting: str, world: int):
    """The node sizes ``NUMBA_CP_NODES`` asks for, or None when it is unset."""
    text = setting.strip()
    if not text:
        return None
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{NODES_ENV}={setting!r}: expected a node count or node sizes "
                         "such as 3,1,4") from None
    if len(values) == 1:
        count = values[0]
        if not 1 <= count <= world:
            raise ValueError(f"{NODES_ENV}={setting!r}: a node count must be in [1, {world}] "
                             f"for {world} ranks")
        base, extra = divmod(world, count)
        return [base + (n < extra) for n in range(count)]
    if min(values) < 1 or sum(values) != world:
        raise ValueError(f"{NODES_ENV}={setting!r}: node sizes must be >= 1 and add up to "
                         f"the {world} ranks")
    return values


def node_layout(comm, sizes=None) -> NodeLayout:
    """The layout of ``comm``'s ranks (collective when ``sizes`` is None: every rank
    asks which ranks share its memory)."""
    if sizes is not None:
        return NodeLayout(tuple(n for n, size in enumerate(sizes) for _ in range(size)))
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        first = local.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        local.Free()
    firsts = allgather_objects(comm, first, "node layout")
    order = {rank: n for n, rank in enumerate(sorted(set(firsts)))}
    return NodeLayout(tuple(order[f] for f in firsts))


def sizes_from_env(world: int):
    """:func:`pretend_sizes` of this process's ``NUMBA_CP_NODES``."""
    return pretend_sizes(os.environ.get(NODES_ENV, ""), world)
