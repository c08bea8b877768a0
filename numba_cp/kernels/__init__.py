"""Device code: kernels and the small device functions they are built from.

Nothing in here validates arguments or picks a launch shape; the host wrappers
in :mod:`numba_cp.ops` do that. Every module takes ``cuda`` from
:mod:`numba_cp.backend`, so one source compiles for HIP, CUDA and the simulator.
"""
