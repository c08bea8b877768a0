"""Instructions per warp and warp-stall shares from an Nsight Compute source page.

    bash benchmarks/ncu_source.sh g merge_topk_ids_and_table g.csv   # one kernel, per SASS line
    python benchmarks/ncu_source_summary.py g.csv [--top 20] [--warps 256]

The CSV is ``ncu -i REPORT --page source --csv --print-source sass``: a row per
SASS instruction with its executions and its warp-stall samples by reason. This
prints the warp instructions executed (per warp with ``--warps``: the launch's
blocks x warps per block), each stall reason's share of the samples, the
program cut at its barriers (each stretch's instructions and samples, with its
two largest reasons: where a kernel's instructions and waits lie between its
steps), and the ``--top`` instructions with the most samples, in program order,
with their two largest reasons. Nothing here asserts a speed; it reads what the
profiler wrote.
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
    """``{"instructions", "segments": [...], "samples", "stalls": {reason: share},
    "top": [...]}``."""
    column = {name: i for i, name in enumerate(header)}
    for needed in (SAMPLES, EXECUTED, "Source"):
        if needed not in column:
            raise ValueError(f"the source page has no {needed!r} column")
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    per_line = [_count(r[column[SAMPLES]]) for r in rows]
    samples = sum(per_line)
    totals = _reason_totals(rows, column, reasons)
    ranked = sorted(range(len(rows)), key=lambda i: -per_line[i])[:top]
    hot = []
    for i in sorted(ranked):
        if not per_line[i]:
            continue
        row = rows[i]
        hot.append({"line": i, "samples": per_line[i],
                    "executed": _count(row[column[EXECUTED]]),
                    "sass": row[column["Source"]].strip(),
                    "reasons": _largest([row], column, reasons)})
    return {"instructions": sum(_count(r[column[EXECUTED]]) for r in rows),
            "segments": _segments(rows, column, reasons, per_line),
            "samples": samples,
            "stalls": {k: v / samples for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
                       if v and samples},
            "top": hot}


def _reason_totals(rows, column, reasons):
    """``{reason: samples}`` over ``rows``."""
    return {n[len("stall_"):]: sum(_count(r[column[n]]) for r in rows) for n in reasons}


def _largest(rows, column, reasons, count=2):
    """The ``count`` reasons with the most samples over ``rows``, largest first."""
    ranked = sorted(((v, k) for k, v in _reason_totals(rows, column, reasons).items() if v),
                    reverse=True)
    return [name for _, name in ranked[:count]]


def _segments(rows, column, reasons, per_line):
    """The program in address order, cut after each barrier (a ``BAR`` instruction):
    ``[{"first", "last", "end", "instructions", "samples", "reasons"}]``."""
    # the opcode is the first word, or the second after a predicate (``@!P2 BAR.RED...``)
    cuts = [i for i, r in enumerate(rows)
            if any(word.startswith("BAR") for word in r[column["Source"]].split()[:2])]
    bounds = [-1, *cuts] + ([len(rows) - 1] if not cuts or cuts[-1] != len(rows) - 1 else [])
    segments = []
    for first, last in zip([b + 1 for b in bounds[:-1]], bounds[1:]):
        part = rows[first:last + 1]
        segments.append({
            "first": first, "last": last,
            "end": part[-1][column["Source"]].strip() if last in cuts else "end",
            "instructions": sum(_count(r[column[EXECUTED]]) for r in part),
            "samples": sum(per_line[first:last + 1]),
            "reasons": _largest(part, column, reasons)})
    return segments


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
    warps = args.warps or 1
    for seg in summary["segments"]:
        print(f"lines {seg['first']:4d}-{seg['last']:<4d} {seg['instructions'] / warps:8.1f} "
              f"instructions{' a warp' if args.warps else ''}, {seg['samples']:4d} samples "
              f"{', '.join(seg['reasons']):24s} up to {seg['end'][:40]}")
    for hot in summary["top"]:
        print(f"{hot['line']:5d} {hot['samples']:5d} x{hot['executed']:<7d} "
              f"{hot['sass'][:60]:60s} {', '.join(hot['reasons'])}")


if __name__ == "__main__":
    main()
