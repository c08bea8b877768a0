"""The rank merge on rows whose gathered runs are out of order, against the oracle.

    PYTHONPATH=CHECKOUT NUMBA_CP_BACKEND=cuda NUMBA_CP_KERNEL_CACHE=0 \
        python -P results/h200-2026-12-05/rank_merge_vote_check.py

from the root of the votes tree (README.md here; its ``tests/test_merge.py``, whose
``test_sorted_gather_fast_path_and_its_check`` took ``(n, swap)``); CHECKOUT holds the
``numba_cp`` package under test.

One line per launch: ``ok`` or the first mismatches. The cases are those of
``tests/test_merge.py`` that failed on the GPU: one row of two ranks with one key
each (runs of two keys span both ranks, so the row is out of order), and
``test_sorted_gather_fast_path_and_its_check`` with and without a swapped pair.
"""
import sys

import numpy as np
sys.path.insert(0, "tests")
import numba_cp
print("numba_cp from", numba_cp.__file__, flush=True)
from numba_cp.testing import ExchangeCase
import test_merge as tm

def one(label, fn):
    try:
        fn()
        print(f"  {label}: ok", flush=True)
    except AssertionError as e:
        lines = [l for l in str(e).splitlines() if "ACTUAL" in l or "DESIRED" in l][:2]
        print(f"  {label}: MISMATCH {' | '.join(l.strip() for l in lines)}", flush=True)
    except Exception as e:
        print(f"  {label}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)

case = ExchangeCase(full_scores=np.array([[[0.34558418, 0.82161814]]], np.float32),
                    seq_lens=np.array([255], np.int32), world=2, topk=2, query_len=1,
                    global_blocks=2, init_blocks=0, local_blocks=0, per_shard=None)
keys = tm.gathered_keys(case, 1)
print("keys", keys.reshape(-1))
for launch in (dict(method="rank"), dict(method="warp")):
    one(f"per_shard1 {launch}", lambda: tm.run_merge(keys, case, **launch))
keys2 = tm.gathered_keys(case, 2)
one("per_shard2 rank", lambda: tm.run_merge(keys2, case, method="rank"))
for swap in (None, "first", "run end"):
    for n in (4, 16):
        one(f"sorted_gather {swap}-{n}", lambda: tm.test_sorted_gather_fast_path_and_its_check(n, swap))
