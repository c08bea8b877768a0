"""Test helpers: arrays on the active backend's memory, and random exchange cases."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from numba_cp import backend
from numba_cp.arrays import device_copy, host_copy
from numba_cp.constants import SPARSE_BLOCK

to_device = device_copy
to_host = host_copy

# Threads per block small enough for the simulator, but not one (races need >1).
THREADS = 4 if backend.is_simulator else 128

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
