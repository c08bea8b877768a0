"""The warp and rank kernels at CUDA's (32) and CDNA's (64) warp widths, on the simulator.

The test suite simulates warps of 8 lanes for speed; the GPUs have 32 or 64.
The lane count changes which stages stay inside a lane and which cross lanes
(warp kernels), and how many threads and keys per thread a row gets (rank
kernels), so each width runs an exchange end to end (pack on every shard, merge, sparse
table, equality with the unsharded oracle), world 1 in one kernel (with the
table) and the two-level exchange's first merge, in a subprocess of its own; and
the pack and merge + table kernels, over arrays by address and over Numba's arrays,
at 32 and 64 lanes.
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


PACK_AND_MERGE_TABLE = """
import numpy as np
import numba_cp
from numba_cp import _numba, ops, reference as ref
method, addressed = {method!r}, {addressed!r}
rng = np.random.default_rng(3)
heads, tokens, blocks, world, topk = 2, 3, 150, 3, 40
scores = rng.standard_normal((heads, tokens, blocks)).astype(np.float32)
seq_lens = np.array([blocks * 128, 97 * 128 + 5, 20 * 128], np.int32)
window = dict(query_len=1, init_blocks=1, local_blocks=2)
shards = [ref.shard_scores(scores, rank=r, world=world, global_blocks=blocks)
          for r in range(world)]
keys = np.zeros((world, heads, tokens, topk), np.int64)
for r in range(world):
    numba_cp.local_topk_keys(shards[r], seq_lens, topk=topk, rank=r, world=world,
                             global_blocks=blocks, out=keys[r], method=method, addressed=addressed,
                             **window)
(pack,) = {{_numba.kernel_py_func(launch.kernel).__name__  # one per rank, one kernel
            for launch in ops._PACK_LAUNCHES.values()}}
expected_keys = np.stack([ref.local_topk_keys(shards[r], seq_lens, topk=topk, rank=r,
                                              world=world, global_blocks=blocks, **window)
                          for r in range(world)])
table = rng.integers(0, 1000, size=(tokens, blocks), dtype=np.int32)
idx = np.full((heads, tokens, topk), -7, np.int32)
sbt = np.full((heads, tokens, topk * 8), -7, np.int32)
ctx = np.full((heads, tokens), -7, np.int32)
numba_cp.merge_topk_keys(keys, idx, seq_lens, attention_block_table=table,
                         sparse_block_table_out=sbt, sparse_context_lens_out=ctx,
                         method=method, addressed=addressed, **window)
exp_idx, exp_sbt, exp_ctx = ref.merge_topk_keys(keys, seq_lens, topk=topk,
                                                attention_block_table=table, **window)
(launch,) = ops._MERGE_LAUNCHES.values()
print(pack, _numba.kernel_py_func(launch.kernel).__name__)
print(np.array_equal(keys, expected_keys), np.array_equal(idx, exp_idx),
      np.array_equal(sbt, exp_sbt), np.array_equal(ctx, exp_ctx))
"""


@pytest.mark.skipif(not TARGET.simulator, reason="sets the simulator's warp width")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["warp", "rank"])
@pytest.mark.parametrize("lanes", [32, 64])
@pytest.mark.parametrize("addressed", [True, False])
def test_pack_and_merge_table_kernels_at_each_warp_width(lanes, method, addressed):
    """The pack and merge + table kernels over arrays by address (the default) and
    over Numba's arrays (``addressed=False``), against the oracle at the GPUs' widths."""
    env = dict(os.environ, NUMBA_CP_BACKEND="sim", NUMBA_CP_SIM_LANES=str(lanes),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = PACK_AND_MERGE_TABLE.format(method=method, addressed=addressed)
    proc = subprocess.run([sys.executable, "-c", script],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by = "_addressed" if addressed else ""
    assert proc.stdout.split() == [f"shard_topk_keys{by}_{method}",
                                   f"merge_topk_ids_and_table{by}_{method}",
                                   "True", "True", "True", "True"], proc.stdout + proc.stderr


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
