"""Run both kernels on the active backend at a chosen shape and check them against the oracle.

    python launch/kernel_check.py --local 2048 --topk 128 --heads 4 --tokens 64

Every rank's shard is packed on this one device, the keys are stacked as the
all-gather would deliver them, merged (with the per-head sparse block table),
and compared with numba_cp.reference: the fake-CP oracle and the unsharded top-k.
Prints one line per check; exit status 1 on any mismatch.
"""

import argparse
import sys
import time

import numpy as np

import numba_cp
from numba_cp import reference as ref
from numba_cp.arrays import device_copy, host_copy
from numba_cp.ops import global_topk_ids, merge_keys
from numba_cp.workload import decode_workload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="batch * query_len")
    p.add_argument("--query-len", type=int, default=1)
    p.add_argument("--local", type=int, default=2048, help="local columns per rank")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--topk", type=int, default=128)
    p.add_argument("--init-blocks", type=int, default=1)
    p.add_argument("--local-blocks", type=int, default=2)
    p.add_argument("--method", choices=numba_cp.METHODS, default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--addressed", choices=("on", "off"), default="on",
                   help="whether the pack and the merge with the table take their arrays "
                        "by address (on, the default) or as Numba's arrays (off)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    work = decode_workload(heads=a.heads, batch=a.tokens // a.query_len, query_len=a.query_len,
                           context=a.local * a.world * 128, seed=a.seed)
    window = dict(query_len=a.query_len, init_blocks=a.init_blocks, local_blocks=a.local_blocks)
    shard_args = dict(window, world=a.world, global_blocks=work.global_blocks)
    print(f"backend: {numba_cp.backend.describe()}")
    print(f"shape: heads={a.heads} tokens={work.tokens} local={a.local} world={a.world} "
          f"topk={a.topk} query_len={a.query_len}")

    seq_lens = device_copy(work.seq_lens)
    gathered = device_copy(np.zeros((a.world, a.heads, work.tokens, a.topk), np.int64))
    shards = [ref.shard_scores(work.full_scores, rank=r, world=a.world,
                               global_blocks=work.global_blocks) for r in range(a.world)]
    start = time.perf_counter()
    for r, shard in enumerate(shards):
        numba_cp.local_topk_keys(device_copy(shard), seq_lens, topk=a.topk, rank=r,
                                 out=gathered[r], method=a.method, threads=a.threads,
                                 addressed=a.addressed == "on", **shard_args)
    requests = work.seq_lens.size
    table = np.random.default_rng(a.seed + 1).integers(
        0, 1 << 20, size=(requests, work.global_blocks), dtype=np.int32)
    topk_idx = device_copy(np.zeros((a.heads, work.tokens, a.topk), np.int32))
    sbt = device_copy(np.zeros((a.heads, work.tokens, a.topk * 8), np.int32))
    ctx = device_copy(np.zeros((a.heads, work.tokens), np.int32))
    numba_cp.merge_topk_keys(gathered, topk_idx, seq_lens, attention_block_table=device_copy(table),
                             sparse_block_table_out=sbt, sparse_context_lens_out=ctx,
                             method=a.method, threads=a.threads, addressed=a.addressed == "on",
                             **window)
    # world 1 in one kernel, on the whole rows, with the table
    whole_idx = device_copy(np.zeros_like(host_copy(topk_idx)))
    whole_sbt = device_copy(np.zeros_like(host_copy(sbt)))
    whole_ctx = device_copy(np.zeros_like(host_copy(ctx)))
    global_topk_ids(device_copy(work.full_scores), seq_lens, whole_idx,
                    global_blocks=work.global_blocks, attention_block_table=device_copy(table),
                    sparse_block_table_out=whole_sbt, sparse_context_lens_out=whole_ctx,
                    method=a.method, threads=a.threads, **window)
    # the two-level exchange's first merge: gathered keys -> keys
    merged_keys = device_copy(np.zeros((a.heads, work.tokens, a.topk), np.int64))
    merge_keys(gathered, seq_lens, topk=a.topk, out=merged_keys, method=a.method,
               threads=a.threads, **window)
    got_keys, got_idx = host_copy(gathered), host_copy(topk_idx)
    got_sbt, got_ctx = host_copy(sbt), host_copy(ctx)
    print(f"kernels (first call, compile included): {time.perf_counter() - start:.2f} s")

    checks = []
    for r, shard in enumerate(shards):
        expected = ref.local_topk_keys(shard, work.seq_lens, topk=a.topk, rank=r, **shard_args)
        checks.append((f"local_topk_keys rank {r}", np.array_equal(got_keys[r], expected)))
    exp_idx, exp_sbt, exp_ctx = ref.merge_topk_keys(
        got_keys, work.seq_lens, topk=a.topk, attention_block_table=table, **window)
    checks.append(("merge_topk_keys topk_idx", np.array_equal(got_idx, exp_idx)))
    checks.append(("merge sparse_block_table", np.array_equal(got_sbt, exp_sbt)))
    checks.append(("merge sparse_context_lens", np.array_equal(got_ctx, exp_ctx)))
    unsharded = ref.global_topk(work.full_scores, work.seq_lens, topk=a.topk,
                                global_blocks=work.global_blocks, **window)
    checks.append(("exchange == unsharded top-k", np.array_equal(got_idx, unsharded)))
    checks.append(("global_topk_ids (world 1, one kernel) == unsharded top-k",
                   np.array_equal(host_copy(whole_idx), unsharded)))
    whole_sbt_want, whole_ctx_want = ref.sparse_block_table(unsharded, work.seq_lens, table,
                                                            query_len=a.query_len)
    checks.append(("global_topk_ids sparse table", np.array_equal(host_copy(whole_sbt),
                                                                  whole_sbt_want)
                   and np.array_equal(host_copy(whole_ctx), whole_ctx_want)))
    want_merged = ref.merge_keys(got_keys, work.seq_lens, topk=a.topk, **window)
    checks.append(("merge_keys == oracle", np.array_equal(host_copy(merged_keys), want_merged)))
    for name, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
