"""The warp and rank kernels at CUDA's (32) and CDNA's (64) warp widths, on the simulator.

The test suite simulates warps of 8 lanes for speed; the GPUs have 32 or 64.
The lane count changes which stages stay inside a lane and which cross lanes
(warp kernels), and how many threads and keys per thread a row gets (rank
kernels), so each width runs an exchange end to end (pack on every shard, merge, sparse
table, equality with the unsharded oracle), world 1 in one kernel (with the
table) and the two-level exchange's first merge, in a subprocess of its own.
"""

import os
import subprocess
import sys

import pytest

from numba_cp.backend import TARGET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not TARGET.simulator, reason="sets the simulator's warp width")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["warp", "rank"])
@pytest.mark.parametrize("lanes", [4, 32, 64])
def test_exchange_is_exact_at_each_warp_width(lanes, method):
    env = dict(os.environ, NUMBA_CP_BACKEND="sim", NUMBA_CP_SIM_LANES=str(lanes),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--local", "100", "--topk", "40", "--heads", "1", "--tokens", "2",
            "--query-len", "2", "--world", "3", "--method", method]
    proc = subprocess.run([sys.executable, "launch/kernel_check.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    for check in ("exchange == unsharded top-k", "global_topk_ids sparse table",
                  "merge_keys == oracle"):
        assert f"ok   {check}" in proc.stdout, proc.stdout


@pytest.mark.parametrize("lanes", ["4", "64", None])
def test_simulated_width_is_the_targets(lanes):
    """NUMBA_CP_SIM_LANES sets TARGET.lanes (8 without it); the kernels' WARP_LANES follows."""
    env = dict(os.environ, NUMBA_CP_BACKEND="sim")
    env.pop("NUMBA_CP_SIM_LANES", None)
    if lanes is not None:
        env["NUMBA_CP_SIM_LANES"] = lanes
    code = ("from numba_cp.backend import TARGET; from numba_cp.kernels.primitives import "
            "WARP_LANES; from numba_cp.kernels.warp import LOG_LANES; "
            "print(TARGET.lanes, WARP_LANES, LOG_LANES)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    width = int(lanes or 8)
    assert proc.stdout.split() == [str(width), str(width), str(width.bit_length() - 1)]


def test_bad_simulated_width_is_named():
    env = dict(os.environ, NUMBA_CP_BACKEND="sim", NUMBA_CP_SIM_LANES="48")
    proc = subprocess.run([sys.executable, "-c", "import numba_cp.kernels.primitives"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "NUMBA_CP_SIM_LANES" in proc.stderr, proc.stderr
