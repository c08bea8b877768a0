"""Test helpers: arrays on the active backend's memory, and random exchange cases."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from numba_cp.arrays import device_copy, host_copy
from numba_cp.backend import TARGET
from numba_cp.constants import SPARSE_BLOCK

to_device = device_copy
to_host = host_copy

# Threads per block small enough for the simulator, but not one (races need >1).
THREADS = 4 if TARGET.simulator else 128


def launches():
    """Launch tuning for either kernel family: results must not depend on it.

    ``"warp"``: one, two or four warps per row and short, default or long
    passes; ``"radix"``: odd and small blocks, and tiny sort tiles that force
    the radix passes.
    """
    lanes = TARGET.lanes
    warp = st.fixed_dictionaries(dict(
        method=st.just("warp"),
        threads=st.sampled_from([None, lanes, 2 * lanes, 4 * lanes]),
        sort_limit=st.sampled_from([None, 1, 4 * lanes])))
    radix = st.fixed_dictionaries(dict(
        method=st.just("radix"), threads=st.sampled_from([1, 3, THREADS]),
        sort_limit=st.sampled_from([None, 1, 5])))
    return st.one_of(warp, radix, st.just(dict(method="auto")))

SPECIAL_SCORES = np.array(
    [np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1e30, 1e29, -1e30, 1e-45, -1e-45, 1.0, -1.0,
     3.4e38], dtype=np.float32)


def score_matrix(rng, shape, mode):
    """float32 scores: 'normal', 'ties' (few distinct values) or 'special' (NaN, -0, inf, pins)."""
    if mode == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if mode == "ties":
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    special = rng.random(shape) < 0.5
    values[special] = rng.choice(SPECIAL_SCORES, size=int(special.sum()))
    return values


def seq_len_choices(rng, requests, query_len, global_blocks):
    """Context lengths mixing padded rows, block edges and lengths past global_blocks."""
    horizon = (global_blocks + 2) * SPARSE_BLOCK
    pool = [-3, 0, 1, max(query_len - 1, 0), query_len, SPARSE_BLOCK, SPARSE_BLOCK + 1,
            2 * SPARSE_BLOCK - 1, horizon]
    out = []
    for _ in range(requests):
        if rng.random() < 0.4:
            out.append(int(rng.choice(pool)))
        else:
            out.append(int(rng.integers(1, horizon + 1)))
    return np.array(out, dtype=np.int32)


@dataclass
class Case:
    full_scores: np.ndarray  # [heads, tokens, global_blocks]
    seq_lens: np.ndarray
    world: int
    topk: int
    query_len: int
    global_blocks: int
    init_blocks: int
    local_blocks: int

    @property
    def window(self):
        return dict(query_len=self.query_len, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks)

    @property
    def shard_args(self):
        return dict(self.window, global_blocks=self.global_blocks, world=self.world)

    @property
    def heads(self):
        return self.full_scores.shape[0]

    @property
    def tokens(self):
        return self.full_scores.shape[1]


@st.composite
def cases(draw, *, max_world=8, max_heads=2, max_requests=3, max_query_len=3,
          max_global_blocks=48, max_topk=12):
    world = draw(st.integers(1, max_world))
    heads = draw(st.integers(1, max_heads))
    requests = draw(st.integers(1, max_requests))
    query_len = draw(st.integers(1, max_query_len))
    global_blocks = draw(st.integers(0, max_global_blocks))
    topk = draw(st.integers(1, max_topk))
    init_blocks = draw(st.integers(0, 3))
    local_blocks = draw(st.integers(0, 3))
    mode = draw(st.sampled_from(["normal", "ties", "special"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = requests * query_len
    return Case(
        full_scores=score_matrix(rng, (heads, tokens, global_blocks), mode),
        seq_lens=seq_len_choices(rng, requests, query_len, global_blocks),
        world=world, topk=topk, query_len=query_len, global_blocks=global_blocks,
        init_blocks=init_blocks, local_blocks=local_blocks)


# -- running ranks under mpiexec ---------------------------------------------------

MPI_TIMEOUT_S = 120


def find_mpiexec():
    """``[mpiexec, flags...]``: the one beside sys.executable (a venv's, matching its MPI
    wheel), else the first on PATH; None if there is none.

    ``NUMBA_CP_MPIEXEC_FLAGS`` adds launcher flags (e.g. ``-launcher fork``).
    """
    import os
    import shlex
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        return None
    flags = shlex.split(os.environ.get("NUMBA_CP_MPIEXEC_FLAGS", ""))
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        flags.append("--oversubscribe")  # 4 ranks on a 2-core machine
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [found, *flags]


def run_mpiexec(command, *, env, cwd, timeout=MPI_TIMEOUT_S):
    """Run an mpiexec command line; kill it and every rank it started if it outlives
    ``timeout``. Returns ``(returncode, combined output)``; a hang fails the test."""
    import os
    import signal
    import subprocess

    import pytest

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=str(cwd), start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(map(str, command[:4]))} ... hung for {timeout} s:\n"
                    f"{output[-4000:]}")
    return process.returncode, output
