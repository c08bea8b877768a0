"""Seeded synthetic decode workloads, identical on every rank that builds one.

The shape follows a long-context decode batch: ``batch`` requests of
``query_len`` query tokens, context lengths uniform in ``[context/2, context]``
with the first request at ``context``, standard-normal index scores for every
one of the ``context / 128`` global blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .constants import SPARSE_BLOCK


@dataclass(frozen=True)
class Workload:
    full_scores: np.ndarray  # float32 [heads, tokens, global_blocks]
    seq_lens: np.ndarray  # int32 [batch]
    query_len: int
    global_blocks: int

    @property
    def heads(self) -> int:
        return self.full_scores.shape[0]

    @property
    def tokens(self) -> int:
        return self.full_scores.shape[1]


def decode_workload(*, heads: int, batch: int, query_len: int, context: int,
                    seed: int = 0) -> Workload:
    if context < SPARSE_BLOCK or context % SPARSE_BLOCK:
        raise ValueError(f"context must be a positive multiple of {SPARSE_BLOCK}, got {context}")
    for name, value in (("heads", heads), ("batch", batch), ("query_len", query_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    global_blocks = context // SPARSE_BLOCK
    seq_lens = rng.integers(context // 2, context + 1, size=batch).astype(np.int32)
    seq_lens[0] = context
    full_scores = rng.standard_normal((heads, batch * query_len, global_blocks),
                                      dtype=np.float32)
    return Workload(full_scores, seq_lens, query_len, global_blocks)
