"""Pretend nodes for the two-level exchange (NUMBA_CP_NODES) and the node layout."""

import pytest

from numba_cp.nodes import NodeLayout, node_layout, pretend_sizes


@pytest.mark.parametrize("setting, world, sizes", [
    ("", 4, None), ("  ", 4, None),
    ("1", 4, [4]), ("2", 4, [2, 2]), ("3", 8, [3, 3, 2]), ("8", 8, [1] * 8),
    ("3,1", 4, [3, 1]), ("1, 3 ,4", 8, [1, 3, 4]),
])
def test_pretend_sizes(setting, world, sizes):
    assert pretend_sizes(setting, world) == sizes


@pytest.mark.parametrize("setting, world, message", [
    ("0", 4, r"a node count must be in \[1, 4\]"),
    ("5", 4, r"a node count must be in \[1, 4\]"),
    ("two", 4, "expected a node count or node sizes"),
    ("3,2", 4, "add up to the 4 ranks"),
    ("4,0", 4, "must be >= 1"),
])
def test_bad_pretend_sizes_name_the_variable(setting, world, message):
    with pytest.raises(ValueError, match=f"NUMBA_CP_NODES={setting!r}: .*{message}"):
        pretend_sizes(setting, world)


def test_layout_of_pretend_nodes():
    layout = node_layout(None, [3, 1, 4])
    assert layout == NodeLayout((0, 0, 0, 1, 2, 2, 2, 2))
    assert layout.nodes == 3 and layout.leaders == [0, 3, 4] and layout.sizes() == [3, 1, 4]


def test_layout_from_shared_memory_is_one_node_here():
    MPI = pytest.importorskip("mpi4py.MPI")
    layout = node_layout(MPI.COMM_SELF)
    assert layout.node_of == (0,) and layout.leaders == [0]
