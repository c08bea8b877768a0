"""Run under mpiexec by tests/comm/test_mpi_jobs.py: one plan, several token counts.

A :class:`~numba_cp.exchange.CandidateExchange` planned for ``max_tokens``
serves calls with fewer tokens through the one transport it set up at
construction. Every rank runs the exchange on its shard of seeded scores for
each token count in ``--tokens`` (in that order) and compares the merged top-k
with :func:`numba_cp.reference.global_topk` on the unsharded scores. With
``--alternate`` every second call runs the steps one by one (pack, all_gather,
merge), which gather separately whether or not the plan's calls are fused. With
``--capture`` the second call and every third after it capture the exchange and
replay it twice.

Output as ``allgather_check.py``: ``rank=R size=N`` first, then
``rank=R OK|FAIL ...`` lines (also to ``--out-dir/rank<R>-pid<PID>.txt``).
Exit status: 0 all exact; 1 a check failed; 3 the world size is not the one
expected; 4 an unexpected error.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from numba_cp import reference as ref
from numba_cp.arrays import device_copy, host_copy
from numba_cp.exchange import CandidateExchange, ExchangeConfig
from rank_lines import begin, say



def workload(seed, heads, tokens, query_len, global_blocks):
    """The same scores and context lengths on every rank (seeded), rows of every kind."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((heads, tokens, global_blocks)).astype(np.float32)
    scores[:, :, rng.integers(0, global_blocks, 3)] = 0.5  # ties across shards
    requests = tokens // query_len
    seq_lens = rng.integers(1, (global_blocks + 2) * 128, requests).astype(np.int32)
    if requests:
        seq_lens[0] = global_blocks * 128
    return scores, seq_lens


def run(args, comm):
    rank, world = comm.Get_rank(), comm.Get_size()
    config = ExchangeConfig(heads=args.heads, max_tokens=args.max_tokens, topk=args.topk,
                            world=world, global_blocks=args.global_blocks, init_blocks=1,
                            local_blocks=1, query_len=args.query_len,
                            sparse_table=args.sparse_table, merge=args.merge,
                            hierarchy=args.hierarchy)
    window = dict(topk=config.topk, query_len=config.query_len,
                  global_blocks=config.global_blocks, init_blocks=config.init_blocks,
                  local_blocks=config.local_blocks)
    failures = 0
    fused = {"auto": None, "on": True, "off": False}[args.fused]
    with CandidateExchange(comm, config, transport=args.transport, fused=fused,
                           method=args.method) as plan:
        transport = plan.transport
        expected_shape = (None if world == 1 and args.hierarchy == "flat"  # nothing moves
                          else (config.heads, config.max_tokens, config.shard_keys))
        if transport.shape != expected_shape:
            failures += 1
            say(rank, f"FAIL transport set up for {transport.shape}, not {expected_shape}")
        def exchange(call, shard, seq_lens, **table):
            if args.capture and call % 3 == 1:  # captured once, replayed twice
                captured = plan.capture(shard, seq_lens, **table)
                captured.replay()
                return captured.replay()
            if not (args.alternate and call % 2):
                return plan(shard, seq_lens, **table)
            tokens = shard.shape[1]
            plan.pack(shard, seq_lens)
            plan.all_gather(tokens, seq_lens=seq_lens)
            return plan.merge(seq_lens, tokens, **table)

        for seed, tokens in enumerate(int(t) for t in args.tokens.split(",")):
            scores, seq_lens = workload(seed, config.heads, tokens, config.query_len,
                                        config.global_blocks)
            shard = ref.shard_scores(scores, rank=rank, world=world,
                                     global_blocks=config.global_blocks)
            want = ref.global_topk(scores, seq_lens, **window)
            if args.sparse_table:  # a page table with gaps: blocks map to scattered pages
                table = np.random.default_rng(seed).permutation(
                    len(seq_lens) * (config.global_blocks + 1)).astype(np.int32).reshape(
                    len(seq_lens), config.global_blocks + 1)
                got = exchange(seed, device_copy(shard), device_copy(seq_lens),
                               attention_block_table=device_copy(table))
                got = np.concatenate([host_copy(a).reshape(-1) for a in got])
                sbt, ctx = ref.sparse_block_table(want, seq_lens, table,
                                                  query_len=config.query_len)
                want = np.concatenate([want[plan.heads.start:plan.heads.stop].reshape(-1),
                                       sbt[plan.heads.start:plan.heads.stop].reshape(-1),
                                       ctx[plan.heads.start:plan.heads.stop].reshape(-1)])
            else:
                got = host_copy(exchange(seed, device_copy(shard), device_copy(seq_lens)))
                want = want[plan.heads.start:plan.heads.stop]
            label = f"transport={transport.name} fused={plan.fused} tokens={tokens}"
            if args.hierarchy != "flat":
                label += f" {plan.describe().split(';')[0]}"
            if plan.fused:  # where the fused gather waits for its peers
                label += (" wait=merge" if "the merge's blocks wait" in plan.describe()
                          else " wait=kernel")
            if plan.transport is not transport:
                failures += 1
                say(rank, f"FAIL {label}: the plan's transport changed")
            elif got.shape == want.shape and np.array_equal(got, want):
                say(rank, f"OK {label}")
            else:
                failures += 1
                say(rank, f"FAIL {label}: differs from the oracle")
        plan.check()
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True, help="the world size expected")
    parser.add_argument("--out-dir")
    parser.add_argument("--transport", default=None)
    parser.add_argument("--fused", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--sparse-table", action="store_true")
    parser.add_argument("--merge", choices=("all", "owned"), default="all")
    parser.add_argument("--method", choices=("auto", "warp", "radix"), default="auto")
    parser.add_argument("--hierarchy", choices=("flat", "node"), default="flat")
    parser.add_argument("--capture", action="store_true",
                        help="every third call is a captured exchange, replayed")
    parser.add_argument("--alternate", action="store_true",
                        help="every second call step by step (pack, all_gather, merge)")
    parser.add_argument("--tokens", default="2,6,0,4,2", help="token counts, in call order")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--topk", type=int, default=5)
    parser.add_argument("--query-len", type=int, default=2)
    parser.add_argument("--global-blocks", type=int, default=23)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, ok = begin(comm, args.out_dir, args.size)
    if not ok:
        return 3
    try:
        return run(args, comm)
    except Exception as exc:  # take the job down rather than leave peers in a collective
        say(rank, f"ERROR {type(exc).__name__}: {exc}")
        comm.Abort(4)
        return 4


if __name__ == "__main__":
    sys.exit(main())
