"""Tables and plots from a launch/scaling.sh run directory.

    python launch/scaling_table.py out/scaling

Prints markdown tables (per case, world and transport: median pack, all-gather,
merge, total and graph replay, one per host iteration and back to back, in us; the
context sweep; the world sweep against
one GPU doing the whole top-k) and writes scaling-context.png and
scaling-world.png there when matplotlib is installed.
"""

import json
import re
import sys
from pathlib import Path

STAGES = ("pack", "all_gather", "merge", "total", "graph_replay", "graph_replay_back_to_back")


def load(out: Path):
    runs = {}
    for path in sorted(out.glob("*.json")):
        try:
            runs[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"skipping unreadable {path}", file=sys.stderr)
    return runs


def cell(stages, stage):
    value = stages.get(stage, {}).get("median_us")
    return "—" if value is None else f"{value:.1f}"


def case_table(runs):
    rows = []
    for name, run in runs.items():
        match = re.fullmatch(r"case-(\w)-w(\d+)-(\S+)", name)
        if match:
            case, world, transport = match.groups()
            rows.append((case, int(world), transport, run))
    if not rows:
        return
    print("| case | world | transport | " + " | ".join(STAGES) + " | exact |")
    print("| --- " * (len(STAGES) + 4) + "|")
    for case, world, transport, run in sorted(rows, key=lambda r: r[:3]):
        print(f"| {case} | {world} | {transport} | "
              + " | ".join(cell(run["stages"], s) for s in STAGES) + f" | {run['exact']} |")
    print()


def sweep_tables(runs, plot_dir):
    context = [(name, run) for name, run in runs.items() if name.startswith("sweep-context")]
    for name, run in context:
        print(f"context sweep, world {run['world']} ({run['transport'].split()[0]}):")
        print("| context | " + " | ".join(STAGES) + " | exact |")
        print("| --- " * (len(STAGES) + 2) + "|")
        for r in run["runs"]:
            print(f"| {r['context']} | " + " | ".join(cell(r["stages"], s) for s in STAGES)
                  + f" | {r['exact']} |")
        print()
        _plot(plot_dir / "scaling-context.png", [r["context"] for r in run["runs"]],
              [r["stages"] for r in run["runs"]], "context (tokens)",
              f"world {run['world']}", log_x=True)
    world = sorted(((run["world"], run) for name, run in runs.items()
                    if name.startswith("sweep-world")), key=lambda item: item[0])
    if world:
        print("world sweep, case b (world 1 = one GPU does the whole top-k):")
        print("| world | transport | " + " | ".join(STAGES) + " | exact |")
        print("| --- " * (len(STAGES) + 3) + "|")
        for w, run in world:
            print(f"| {w} | {run['transport'].split()[0]} | "
                  + " | ".join(cell(run["stages"], s) for s in STAGES) + f" | {run['exact']} |")
        print()
        _plot(plot_dir / "scaling-world.png", [w for w, _ in world],
              [run["stages"] for _, run in world], "world (GPUs)", "case b")


def _plot(path, xs, stages, xlabel, title, log_x=False):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in STAGES:
        ys = [s.get(stage, {}).get("median_us") for s in stages]
        if any(y is not None for y in ys):
            ax.plot(xs, ys, marker="o", label=stage)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("median us per step")
    ax.set_title(f"numba_cp exchange, {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "out/scaling")
    runs = load(out)
    if not runs:
        print(f"no results in {out}")
        return 1
    case_table(runs)
    sweep_tables(runs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
