"""Other checkouts of numba_cp against this one, in one process, on the same arrays.

    NUMBA_CP_BACKEND=cuda python benchmarks/compare_trees.py [CHECKOUT ...]
        [--cases a,b,c,d,g] [--repeats 5] [--warm] [--unchained] [--json F]

Kernel times of two trees measured in two processes differ by up to 0.2 µs on
these small rows even for the same kernel: each process's arrays land at other
addresses. Here every tree launches on the very same arrays, so only the kernels
differ. Each CHECKOUT's ``numba_cp`` package is copied under a name of its own
(``numba_cp_1``, ...; the package imports itself only relatively) and keeps its own
kernel cache. For each bench_kernels.py case: the pack (cases without a table), the
merge, world 1 in one kernel, and in case g the warp kernels' merge too, and where the
tree takes ``addressed=`` the pack and merges again with Numba's array parameters
(``addressed=False``; its default takes the arrays by address), each the
median of ``--repeats`` CUDA-graph timings interleaved across the trees. ``--warm``
only compiles (run one per tree in parallel first: ``--only N``, 0 being this
tree). Speed is only ever measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench_kernels import CASES, case_arrays, device_us
from numba_cp.workload import decode_workload

TABLES = ("attention_block_table", "sparse_block_table_out", "sparse_context_lens_out")


def load_trees(checkouts):
    """``[(label, package)]``: this tree's numba_cp, then each checkout's under a new name."""
    import numba_cp

    trees = [("this tree", numba_cp)]
    copies = tempfile.mkdtemp(prefix="numba_cp_trees_")
    sys.path.insert(0, copies)
    for n, checkout in enumerate(checkouts, 1):
        source = os.path.join(checkout, "numba_cp")
        if not os.path.isfile(os.path.join(source, "__init__.py")):
            raise SystemExit(f"{checkout}: no numba_cp package in it")
        shutil.copytree(source, os.path.join(copies, f"numba_cp_{n}"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        trees.append((checkout, importlib.import_module(f"numba_cp_{n}")))
    return trees


def calls(name, trees):
    """``[(case, stage, tree label, call(stream))]`` for case ``name``."""
    import cupy

    topk, window, shard_args, a = case_arrays(name)
    context, _, _, batch, query_len, heads, table_on = CASES[name]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context,
                           seed=0)
    full = cupy.asarray(work.full_scores)
    tables = {k: a[k] for k in TABLES if k in a}
    world1_idx = cupy.zeros_like(a["topk_idx"])
    world1_tables = {k: cupy.zeros_like(v) if k.endswith("_out") else v
                     for k, v in tables.items()}
    out = []
    for label, pkg in trees:
        def pack(s, pkg=pkg, **launch):
            pkg.local_topk_keys(a["scores"], a["seq_lens"], topk=topk, rank=0, out=a["out"],
                                stream=s, **shard_args, **launch)

        def merge(s, pkg=pkg, **launch):
            pkg.merge_topk_keys(a["keys"], a["topk_idx"], a["seq_lens"], stream=s, **window,
                                **tables, **launch)

        def world1(s, pkg=pkg):
            pkg.ops.global_topk_ids(full, a["seq_lens"], world1_idx, stream=s,
                                    global_blocks=work.global_blocks, **window,
                                    **world1_tables)

        if not table_on:
            out.append((name, "pack", label, pack))
            if "addressed" in inspect.signature(pkg.local_topk_keys).parameters:
                out.append((name, "pack, Numba's arrays", label,
                            lambda s, pack=pack: pack(s, addressed=False)))
        out.append((name, "merge", label, merge))
        if table_on:
            out.append((name, "merge (warp)", label,
                        lambda s, merge=merge: merge(s, method="warp")))
            if "addressed" in inspect.signature(pkg.merge_topk_keys).parameters:
                out.append((name, "merge, Numba's arrays", label,
                            lambda s, merge=merge: merge(s, addressed=False)))
                out.append((name, "merge (warp), Numba's arrays", label,
                            lambda s, merge=merge: merge(s, method="warp", addressed=False)))
        out.append((name, "world 1", label, world1))
    return out


def unchained(row, trees):
    """The row again with chained launches off, for a tree that has them."""
    case, stage, label, call = row
    launcher = getattr(dict(trees)[label], "launcher", None)
    if not hasattr(launcher, "set_chained_launches"):
        return []

    def ordinary(s):
        previous = launcher.set_chained_launches(False)
        try:
            call(s)
        finally:
            launcher.set_chained_launches(previous)

    return [(case, stage, f"{label}, chained launches off", ordinary)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkouts", nargs="*", help="repository roots of the other trees")
    p.add_argument("--cases", default="a,b,c,d,g")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warm", action="store_true", help="compile and launch once, no timing")
    p.add_argument("--only", type=int, default=None, help="with --warm: just tree N")
    p.add_argument("--json", default=None)
    p.add_argument("--unchained", action="store_true",
                   help="also time each tree that chains launches with chaining off")
    args = p.parse_args(argv)
    import numba_cp

    if numba_cp.backend.TARGET.simulator:
        raise SystemExit("compare_trees.py times a GPU: run it with NUMBA_CP_BACKEND=cuda")
    import cupy

    trees = load_trees(args.checkouts)
    if args.only is not None:
        trees = [trees[args.only]]
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {sorted(CASES)}")
    todo = [c for name in cases for c in calls(name, trees)]
    if args.unchained:
        todo = [row for c in todo for row in (c, *unchained(c, trees))]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for *_, call in todo:
            call(stream)
        stream.synchronize()
        if args.warm:
            return 0
        times = [[] for _ in todo]
        for _ in range(args.repeats):
            for timed, (*_, call) in zip(times, todo):
                timed.append(device_us(call, stream, 50, 20))
    rows = []
    print("device µs per call, CUDA-graph replay, median of "
          f"{args.repeats} (min-max); every tree on the same arrays")
    for timed, (case, stage, label, _) in zip(times, todo):
        median = statistics.median(timed)
        rows.append(dict(case=case, stage=stage, tree=label, device_us=timed, median_us=median))
        print(f"{case} {stage:<26} {median:6.2f} ({min(timed):.2f}-{max(timed):.2f})  {label}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=numba_cp.backend.describe(), date=time.strftime("%Y-%m-%d"),
                           argv=sys.argv[1:], rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
