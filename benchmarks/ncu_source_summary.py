"""Instructions per warp and warp-stall shares from an Nsight Compute source page.

    bash benchmarks/ncu_source.sh g merge_topk_ids_and_table g.csv   # one kernel, per SASS line
    python benchmarks/ncu_source_summary.py g.csv [--top 20] [--warps 256]

The CSV is ``ncu -i REPORT --page source --csv --print-source sass``: a row per
SASS instruction with its executions and its warp-stall samples by reason. This
prints the warp instructions executed (per warp with ``--warps``: the launch's
blocks x warps per block), each stall reason's share of the samples, and the
``--top`` instructions with the most samples, in program order, with their two
largest reasons. Nothing here asserts a speed; it reads what the profiler wrote.
"""

from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_page(path):
    """``(header, rows)``: the table under the page's ``Address`` header line."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    start = next((i for i, r in enumerate(lines) if r and r[0] == "Address"), None)
    if start is None:
        raise ValueError(f"{path}: no 'Address' header; expected `ncu --page source --csv`")
    header = lines[start]
    return header, [r for r in lines[start + 1:] if len(r) == len(header)]


def _count(text):
    return int(text) if text.strip().lstrip("-").isdigit() else 0


def summarize(header, rows, top=20):
    """``{"instructions", "samples", "stalls": {reason: share}, "top": [...]}``."""
    column = {name: i for i, name in enumerate(header)}
    for needed in (SAMPLES, EXECUTED, "Source"):
        if needed not in column:
            raise ValueError(f"the source page has no {needed!r} column")
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    per_line = [_count(r[column[SAMPLES]]) for r in rows]
    samples = sum(per_line)
    totals = {n[len("stall_"):]: sum(_count(r[column[n]]) for r in rows) for n in reasons}
    ranked = sorted(range(len(rows)), key=lambda i: -per_line[i])[:top]
    hot = []
    for i in sorted(ranked):
        if not per_line[i]:
            continue
        row = rows[i]
        by_reason = sorted(((_count(row[column[n]]), n[len("stall_"):]) for n in reasons),
                           reverse=True)
        hot.append({"line": i, "samples": per_line[i],
                    "executed": _count(row[column[EXECUTED]]),
                    "sass": row[column["Source"]].strip(),
                    "reasons": [name for count, name in by_reason[:2] if count]})
    return {"instructions": sum(_count(r[column[EXECUTED]]) for r in rows),
            "samples": samples,
            "stalls": {k: v / samples for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
                       if v and samples},
            "top": hot}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--warps", type=int, default=None, help="warps in the launch")
    args = p.parse_args(argv)
    summary = summarize(*read_source_page(args.csv), top=args.top)
    per_warp = (f", {summary['instructions'] / args.warps:.0f} per warp" if args.warps
                else "")
    print(f"{args.csv}: {summary['instructions']} warp instructions executed{per_warp}, "
          f"{summary['samples']} stall samples")
    print("  ".join(f"{k} {v:.0%}" for k, v in summary["stalls"].items()))
    for hot in summary["top"]:
        print(f"{hot['line']:5d} {hot['samples']:5d} x{hot['executed']:<7d} "
              f"{hot['sass'][:60]:60s} {', '.join(hot['reasons'])}")


if __name__ == "__main__":
    main()
