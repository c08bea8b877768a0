"""The main job from a checkout: ``mpiexec -n 4 python launch/exchange.py [options]``.

The job itself is :mod:`numba_cp.main_job`, installed as the console command
``numba-cp-exchange``; this file only runs it (``--help`` lists the options).
"""

from numba_cp.main_job import cli

if __name__ == "__main__":
    cli()
