"""What the main job prints and writes: a header, the timing table, JSON and a plot.

Pure functions of the figures the ranks measured, so they are tested without
MPI. The table follows the benchmark suites users know (nccl-tests, OSU): it
says how many iterations ran, how ranks are aggregated, what the all-gather
moved and at what bandwidth, and whether the figures can be read as
performance at all.
"""

from __future__ import annotations

import platform
import re
import sys
import textwrap
from importlib import metadata

import numpy as np

__all__ = ["STAGES", "REPLAY_STAGES", "JSON_FORMAT", "mpi_library_name", "package_versions",
           "driver_version", "stage_statistics", "gather_payload", "format_ranks",
           "format_timings", "replay_label", "plot_sweep", "command_line"]

STAGES = ("pack", "all_gather", "merge", "total")
# graph_replay: one replay and a stream synchronisation per host iteration (launch
# latency included); graph_replay_back_to_back: replays queued back to back with one
# synchronisation, per exchange (the device's time once launches overlap).
REPLAY_STAGES = ("graph_replay", "graph_replay_back_to_back")
JSON_FORMAT = "numba_cp-exchange/2"
AGGREGATION = ("per iteration, the slowest rank's time (ranks start each iteration together "
               "after a barrier); min, median, p90 and max over iterations")

_MPI_PATTERNS = (
    (r"CRAY MPICH version (\S+)", "Cray MPICH {}"),
    (r"Open MPI v(\d[^,\s]*)", "Open MPI {}"),
    (r"Intel\(R\) MPI Library (\S+)", "Intel MPI {}"),
    (r"MVAPICH2? Version\s*:\s*(\S+)", "MVAPICH {}"),
    (r"MPICH Version\s*:\s*(\S+)", "MPICH {}"),
)


def mpi_library_name(version_text: str) -> str:
    """'MPICH Version:      5.0.2\\nMPICH Release date: ...' -> 'MPICH 5.0.2'.

    ``MPI.Get_library_version()`` differs by vendor (and ends in a NUL): the
    known vendors become '<name> <version>', anything else its first line.
    """
    text = version_text.replace("\x00", "")
    for pattern, name in _MPI_PATTERNS:
        match = re.search(pattern, text, flags=re.I)
        if match:
            return name.format(match.group(1).rstrip(",;"))
    first = next((line for line in text.splitlines() if line.strip()), "unknown")
    return " ".join(first.split())


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str]:
    """The versions that decide what ran: this package, Python and the Numba stack."""
    from . import __version__

    versions = {"numba_cp": __version__, "python": platform.python_version()}
    for name in ("numba", "numba-cuda", "numba-hip", "llvmlite", "numpy", "mpi4py",
                 "cupy-cuda13x", "cupy-cuda12x", "cupy-rocm-7-0"):
        found = _version(name)
        if found is not None:
            versions[name] = found
    return versions


def driver_version(target_name: str) -> str:
    """The GPU driver's version as its runtime reports it ('none' under the simulator)."""
    if target_name == "sim":
        return "none (CPU simulator)"
    try:
        import cupy

        raw = int(cupy.cuda.runtime.driverGetVersion())
    except Exception as exc:  # no CuPy, or no driver: say so rather than fail the job
        return f"unknown ({type(exc).__name__})"
    if target_name == "hip":  # HIP_VERSION: major * 10^7 + minor * 10^5 + patch
        return f"HIP {raw // 10_000_000}.{raw // 100_000 % 100}.{raw % 100_000}"
    return f"CUDA {raw // 1000}.{raw % 1000 // 10}"


def stage_statistics(per_rank_seconds: np.ndarray) -> dict[str, float]:
    """``[world, iterations]`` seconds of one stage -> min/median/p90/max in us of the
    slowest rank per iteration."""
    slowest = np.asarray(per_rank_seconds, dtype=float).max(axis=0) * 1e6
    return {"min_us": float(slowest.min()), "median_us": float(np.median(slowest)),
            "p90_us": float(np.percentile(slowest, 90)), "max_us": float(slowest.max())}


def gather_payload(*, world: int, heads: int, tokens: int, keys: int,
                   median_us: float | None) -> dict:
    """Bytes the all-gather moves, and its bandwidth at the median time, as nccl-tests
    counts them: algbw = bytes received / time, busbw = algbw * (world - 1) / world."""
    sent = heads * tokens * keys * 8  # int64 keys
    received = world * sent
    payload = {"bytes_sent_per_rank": sent, "bytes_received_per_rank": received,
               "algbw_GBps": None, "busbw_GBps": None}
    if world > 1 and median_us:
        algbw = received / (median_us * 1e-6) / 1e9
        payload.update(algbw_GBps=algbw, busbw_GBps=algbw * (world - 1) / world)
    return payload


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def format_ranks(ranks: list[dict], limit: int = 16) -> list[str]:
    """One line per rank (host and device); past ``limit`` ranks, one line per host."""
    if len(ranks) <= limit:
        return [f"  rank {r['rank']}: {r['host']} {r['device']}" for r in ranks]
    hosts: dict[str, list[dict]] = {}
    for r in ranks:
        hosts.setdefault(r["host"], []).append(r)
    return [f"  {host}: ranks {members[0]['rank']}..{members[-1]['rank']} "
            f"({len(members)} ranks; {', '.join(sorted({m['device'] for m in members}))})"
            for host, members in hosts.items()]


def _bandwidth(gigabytes_per_s: float) -> str:
    if gigabytes_per_s >= 0.1:
        return f"{gigabytes_per_s:.2f} GB/s"
    return f"{gigabytes_per_s * 1e3:.3g} MB/s"


def _prose(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, 100, initial_indent=indent, subsequent_indent=indent + "  ")


def replay_label(stage: str, replays: int | None) -> str:
    return {"graph_replay": "replay, 1 per iteration",
            "graph_replay_back_to_back": f"replay, {replays} back to back"}.get(stage, stage)


def format_timings(run: dict, *, iters: int, warmup: int, replays: int | None,
                   simulator: bool, explain: bool = True) -> list[str]:
    """The timing table of one run; with ``explain``, what every number means (a sweep
    explains its first table only)."""
    stages = run["stages"]
    plural = "s" if iters != 1 else ""
    lines = []
    if explain:
        lines += _prose(f"timings in us over {iters} timed iteration{plural} (after {warmup} "
                        "warm-up): each figure is the slowest rank's time in its iteration "
                        "(the ranks start each iteration together), so the stages need not "
                        "add up to total, which is the slowest rank's own sum.")
    if warmup == 0 and explain:
        lines += _prose("--warmup 0: the first timed iteration includes the first call's "
                        "compilation.")
    lines.append(f"{'stage':<28}{'min':>12}{'median':>12}{'p90':>12}{'max':>12}")
    for stage, s in stages.items():
        lines.append(f"{replay_label(stage, replays):<28}{s['min_us']:>12.1f}"
                     f"{s['median_us']:>12.1f}{s['p90_us']:>12.1f}{s['max_us']:>12.1f}")
    if "graph_replay" in stages and explain:
        lines += _prose(f"{replay_label('graph_replay', replays)}: a replay of the captured "
                        "exchange, then a stream synchronisation (host launch latency "
                        "included).", "  ")
        lines += _prose(f"{replay_label('graph_replay_back_to_back', replays)}: {replays} "
                        "replays queued, one synchronisation at the end, time per exchange "
                        "(with a device-side gather: the device's time per exchange).", "  ")
    payload = run["all_gather"]
    c = run["config"]
    if c.get("hierarchy") == "node":
        lines += _prose("all_gather: two levels, so its time covers the gather inside each "
                        "node, the node's merge into keys and the gather of the nodes' keys "
                        "(no single payload or bandwidth to report).")
    elif c["world"] == 1:
        lines.append("all_gather: none at world 1 (the shard's keys are the gathered keys)")
    else:
        keys = c["topk"] if c["per_shard"] is None else c["per_shard"]
        lines += _prose(
            f"all_gather payload: each rank sends {_bytes(payload['bytes_sent_per_rank'])} "
            f"and receives {_bytes(payload['bytes_received_per_rank'])} ({c['world']} ranks x "
            f"{c['heads']} heads x {run['tokens']} tokens x {keys} keys x 8 B); at the median "
            f"time: algbw {_bandwidth(payload['algbw_GBps'])} (bytes received / time), busbw "
            f"{_bandwidth(payload['busbw_GBps'])} (algbw x (world-1)/world).")
    if simulator and explain:
        lines += _prose("note: Numba's CUDA simulator ran these kernels, every GPU thread a "
                        "Python thread on the CPU: the timings show that the flow works, not "
                        "how fast it runs.")
    return lines


def plot_sweep(runs: list[dict], path, *, world: int, backend: str,
               replays: int | None = None) -> None:
    """Median time per stage against context (log2 axis), as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [r["context"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in runs[0]["stages"]:
        ax.plot(contexts, [r["stages"][stage]["median_us"] for r in runs], marker="o",
                label=replay_label(stage, replays))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("median us per step (slowest rank)")
    suffix = " (simulator: not performance)" if backend == "sim" else ""
    ax.set_title(f"CP candidate exchange, world {world}, {backend}{suffix}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command_line() -> list[str]:
    """This process's command line as started (``python -m numba_cp.main_job ...``, the
    console script, or a script); ``sys.argv[0]`` alone hides ``-m``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]
