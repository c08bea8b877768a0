"""Device code: kernels and the small device functions they are built from.

=================  ===========================================================
``rows.py``        what every family shares: row window, candidate readers,
                   the sparse-table writer, the kernels' parameter declarations
``shells.py``      the kernels the warp and rank families build from their
                   row selection
``warp.py``        the warp family (``method="warp"``): registers and shuffles
``rank.py``        the rank family (``method="rank"``): each key's place counted,
                   for short rows on small grids
``radix.py``       the radix family (``method="radix"``): any ``topk``
``keys.py``        the packed int64 key and the row window's arithmetic
``ipc.py``         the IPC all-gather's kernels and its protocol note
``primitives.py``  the few primitives whose spelling differs between targets
``params.py``      how a kernel declares its parameters, once
=================  ===========================================================

Nothing in here validates arguments or picks a launch shape; the host wrappers
in :mod:`numba_cp.ops` do that. Every module takes ``cuda`` from
:mod:`numba_cp.backend`, so one source compiles for HIP, CUDA and the simulator.
"""
