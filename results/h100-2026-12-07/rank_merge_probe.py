"""The merge + table example of tests/test_merge.py's one-key-each test, or one variant of it,
in one process: which change lets the launch finish on a GPU.

    NUMBA_CP_BACKEND=cuda timeout 100 python results/h100-2026-12-07/rank_merge_probe.py VARIANT

VARIANT: base (the pinned example: world 2, topk 6, query_len 3, three heads, the rank
merge + table by address, page stride 0), finite (NaN and inf scores replaced), seq256
(a request of 256 tokens), topk8 (runs of eight keys per rank, in order), array (Numba's
array parameters), warp (the warp family), stride16 (page stride 16), notable (the merge
alone), threads64 (the rank family at 64 threads). Prints "VARIANT: passed in S s" when
the outputs match the oracle; with NUMBA_CP_CHAINED_LAUNCH=0 the same without chained
launches.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import numpy as np
import test_merge as tm
from support import Case

variant = sys.argv[1]
scores = tm.one_key_each_scores()
if variant == "finite":
    scores = np.nan_to_num(scores, nan=0.25, posinf=1.0, neginf=-1.0)
seq = 255
world, topk, ql = 2, 6, 3
if variant == "seq256":
    seq = 256
if variant == "topk8":
    topk = 8
case = Case(scores, np.array([seq], np.int32), world=world, topk=topk, query_len=ql,
            global_blocks=25, init_blocks=0, local_blocks=1)
keys = tm.gathered_keys(case, case.topk)
table = tm.block_table(np.random.default_rng(60523), case)
launch = dict(method="auto", addressed=True)
stride = 0
if variant == "array":
    launch["addressed"] = False
if variant == "warp":
    launch["method"] = "warp"
if variant == "stride16":
    stride = 16
if variant == "notable":
    table = None
if variant == "threads64":
    launch.update(method="rank", threads=64)
t = time.time()
tm.run_merge(keys, case, table=table, stride=stride, **launch)
print(f"{variant}: passed in {time.time() - t:.1f} s", flush=True)
