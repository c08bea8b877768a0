"""The main job's command line, checked before any MPI work starts.

Every rank of a job parses the same arguments, so every rank reaches the same
verdict: a bad option ends every rank with exit status 2 and one line, as
argparse does, instead of a traceback and an ``MPI_Abort``. The checks run in
two steps: :func:`parse_options` needs nothing but the arguments (and runs
before mpi4py is imported), :func:`check_with_world` needs the world size and
runs before the first collective.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from pathlib import Path

import numpy as np

from .backend import TARGET
from .constants import MAX_GLOBAL_BLOCKS, MAX_PINNED, MAX_TOPK, SPARSE_BLOCK

__all__ = ["PROG", "ENVIRONMENT", "TRANSPORT_CHOICES", "OptionError", "token_count",
           "build_parser", "parse_options", "check_with_world", "launcher_rank",
           "report_option_error"]

PROG = "numba-cp-exchange"
TRANSPORT_CHOICES = ("host", "mpi-device", "staged", "ipc", "nccl")
METHOD_CHOICES = ("auto", "warp", "radix")
MAX_CONTEXT = (MAX_GLOBAL_BLOCKS - 1) * SPARSE_BLOCK
MAX_THREADS = 1024  # threads per block on every target

# Every environment variable the package (and this job) reads, for --help.
ENVIRONMENT = (
    ("NUMBA_CP_BACKEND", "hip | cuda | sim: the kernel target (default: picked from the "
                         "hardware)"),
    ("NUMBA_CP_SIM_LANES", "lanes per simulated warp, a power of two from 2 to 64 (default 8)"),
    ("NUMBA_CP_TRANSPORT", "host | mpi-device | staged | ipc | nccl: force the all-gather "
                           "transport (--transport wins)"),
    ("NUMBA_CP_GPU_AWARE_MPI", "0 | 1: override the detection of a GPU-aware MPI"),
    ("NUMBA_CP_TIMEOUT", "seconds a host collective waits for its peers (default 60 on a GPU, "
                         "300 under the simulator)"),
    ("NUMBA_CP_IPC_TIMEOUT", "seconds an IPC wait spins before it poisons its peers "
                             "(default 5; 60 under the simulator)"),
    ("NUMBA_CP_IPC_WAIT", "merge | kernel: where the fused IPC exchange waits for its peers "
                          "(default: in the merge when every rank has a GPU of its own, else "
                          "in one small kernel)"),
    ("NUMBA_CP_NODES", "N or sizes like 3,1,4: pretend nodes for --hierarchy node (default: "
                       "the ranks that share memory)"),
    ("NUMBA_CP_KERNEL_CACHE", "0: compile kernels in every process; a folder: keep compiled "
                              "kernels there (default ~/.cache/numba_cp; CUDA only)"),
    ("NUMBA_CP_CHAINED_LAUNCH", "0: launch every kernel the ordinary way (default: the "
                                "pack and the merges may start while the kernel ahead of them "
                                "ends, on NVIDIA GPUs of compute capability 9.0 and newer)"),
    ("NUMBA_CP_ADDRESSED", "0: the small-row pack and merge + table kernels take Numba's "
                           "array parameters (default: their arrays by address where every "
                           "array is C-contiguous)"),
    ("NUMBA_CP_COMPILE_ONLY", "1: load a GPU target without a GPU (compile checks only)"),
    ("NUMBA_CP_LLD", "ld.lld that links AMDGPU code objects (python -m "
                     "numba_cp.compile_check)"),
)


class OptionError(Exception):
    """A bad command-line option or environment variable: one line, exit status 2."""


def token_count(text: str) -> int:
    """'128K' -> 131072, '1M' -> 1048576, '4096' -> 4096 (a positive multiple of 128)."""
    cleaned = str(text).strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(cleaned[-1:], 1)
    digits = cleaned[:-1] if scale > 1 else cleaned
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 32768, 32K, 1M)")
    tokens = int(digits) * scale
    if tokens < SPARSE_BLOCK or tokens % SPARSE_BLOCK:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive multiple of {SPARSE_BLOCK} tokens (e.g. 4096, 32K, 1M)")
    if tokens > MAX_CONTEXT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is past the largest context, {MAX_CONTEXT} tokens "
            f"({MAX_GLOBAL_BLOCKS - 1} blocks of {SPARSE_BLOCK})")
    return tokens


def token_counts(text: str) -> list[int]:
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated contexts, e.g. 8K,32K,128K")
    return [token_count(item) for item in items]


def _bounded(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    def convert(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    convert.__name__ = "integer"
    return convert


def launcher_rank() -> int | None:
    """This process's rank as its launcher announced it, read before MPI is initialised
    (None when not started by a known launcher)."""
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
                "SLURM_PROCID", "PALS_RANKID"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return None


def report_option_error(message: str) -> None:
    """One line on stderr, from one rank: every rank has the same verdict."""
    if launcher_rank() in (None, 0):
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, no usage block
        raise OptionError(message)

    def print_help(self, file=None):  # --help under mpiexec: once, not once per rank
        if launcher_rank() in (None, 0):
            super().print_help(file)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    pass


def _environment_epilog() -> str:
    width = max(len(name) for name, _ in ENVIRONMENT)
    lines = ["environment variables the package reads:"]
    for name, what in ENVIRONMENT:
        lines += textwrap.wrap(what, 96, initial_indent=f"  {name:<{width}}  ",
                               subsequent_indent=" " * (width + 4))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    simulator = TARGET.simulator
    defaults = (dict(heads=2, batch=8, context="16K", topk=16, iters=3, warmup=1, replays=2)
                if simulator else
                dict(heads=4, batch=64, context="128K", topk=16, iters=50, warmup=5,
                     replays=20))
    p = _Parser(
        prog=PROG, formatter_class=_HelpFormatter, epilog=_environment_epilog(),
        description="The CP candidate exchange under MPI (pack -> all-gather -> merge): "
                    "checks the merged top-k against the unsharded NumPy oracle and times "
                    "each stage.\n\n  mpiexec -n 4 numba-cp-exchange [options]\n\n"
                    "Defaults are a decode shape on a GPU and a small one under the CPU "
                    "simulator (this machine: " + ("simulator" if simulator else TARGET.name)
                    + "). Exit status: 0 exact, 1 inexact, 2 bad option or error.")
    p.add_argument("--heads", type=_bounded(1), default=defaults["heads"], help="index heads")
    p.add_argument("--batch", type=_bounded(1), default=defaults["batch"],
                   help="requests per step")
    p.add_argument("--query-len", type=_bounded(1), default=1,
                   help="query tokens per request (>1: speculative/MTP rows)")
    p.add_argument("--context", type=token_count, default=token_count(defaults["context"]),
                   help="longest context in tokens: a multiple of 128; suffixes K and M")
    p.add_argument("--topk", type=_bounded(1, MAX_TOPK), default=defaults["topk"],
                   help="blocks selected per row")
    p.add_argument("--init-blocks", type=_bounded(0, MAX_PINNED), default=1,
                   help="pinned sink blocks")
    p.add_argument("--local-blocks", type=_bounded(0, MAX_PINNED), default=2,
                   help="pinned most-recent blocks")
    p.add_argument("--merge", choices=("all", "owned"), default="all",
                   help="merge every head on every rank, or only this rank's slice of heads")
    p.add_argument("--sparse-table", action="store_true",
                   help="also emit the paged sparse block table (checked against the oracle)")
    p.add_argument("--hierarchy", choices=("flat", "node"), default="flat",
                   help="flat: one all-gather over every rank; node: gather and merge inside "
                        "each node, then gather the nodes' keys (NUMBA_CP_NODES pretends)")
    p.add_argument("--transport", choices=TRANSPORT_CHOICES, default=None,
                   help="force the all-gather transport (default: the best for this machine)")
    p.add_argument("--graph", action="store_true",
                   help="also capture the exchange (CUDA/HIP graph) and time its replays, one "
                        "per host iteration and back to back; with an MPI gather, pack and "
                        "merge are two graphs around it")
    p.add_argument("--replays", type=_bounded(1), default=defaults["replays"],
                   help="--graph: back-to-back replays per timed iteration")
    p.add_argument("--iters", type=_bounded(1), default=defaults["iters"],
                   help="timed iterations")
    p.add_argument("--warmup", type=_bounded(0), default=defaults["warmup"],
                   help="untimed iterations first (the first call compiles the kernels)")
    p.add_argument("--seed", type=_bounded(0), default=0,
                   help="workload seed, the same on every rank")
    p.add_argument("--scores", type=Path, default=None,
                   help="load full-context scores float32 [heads, tokens, blocks] from .npy "
                        "(needs --seq-lens; --heads, --batch and --context then follow it)")
    p.add_argument("--seq-lens", type=Path, default=None,
                   help="integer [requests] .npy for --scores")
    p.add_argument("--sweep-context", type=token_counts, default=None,
                   help="comma-separated contexts to run one after another, e.g. 8K,32K,128K")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None,
                   help="write a PNG of the stages against context here (needs matplotlib)")
    p.add_argument("--method", choices=METHOD_CHOICES, default="auto",
                   help="kernel family (numba_cp.METHODS)")
    p.add_argument("--threads", type=_bounded(1, MAX_THREADS), default=None,
                   help="threads per kernel block (default: the kernel family's)")
    p.add_argument("--fail-rank", type=_bounded(0), default=None,
                   help="(testing) raise on this rank after setup, to show the job aborts")
    return p


def parse_options(argv=None) -> argparse.Namespace:
    """The checked options; raises OptionError (one line) on anything wrong.

    Everything that can be known without MPI is checked here: values and
    ranges, files, the plot's dependency, the output folders, the kernel family
    for topk, and the transport and timeout variables of the environment.
    """
    args = build_parser().parse_args(argv)
    args.contexts = args.sweep_context or [args.context]
    if (args.scores is None) != (args.seq_lens is None):
        raise OptionError("argument --scores: --scores and --seq-lens go together")
    if args.scores is not None:
        if args.sweep_context:
            raise OptionError("argument --sweep-context: not with --scores (the file fixes "
                              "the context)")
        args.loaded = _load_scores(args.scores, args.seq_lens, args.query_len)
        args.contexts = [args.loaded[0].shape[2] * SPARSE_BLOCK]
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.resolve().is_dir():
            raise OptionError(f"argument {option}: folder {str(path.parent)!r} does not exist")
    if args.plot is not None:
        try:
            importlib.import_module("matplotlib")
        except ImportError as exc:
            raise OptionError(f"argument --plot: needs matplotlib ({exc}); pip install "
                              "matplotlib, or leave out --plot") from None
    _check_package_choices(args)
    return args


def _load_scores(scores_path: Path, seq_lens_path: Path, query_len: int):
    arrays = []
    for option, path in (("--scores", scores_path), ("--seq-lens", seq_lens_path)):
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise OptionError(f"argument {option}: cannot read {str(path)!r} as .npy: "
                              f"{exc}") from None
    scores, seq_lens = arrays
    if scores.ndim != 3 or scores.dtype.kind != "f":
        raise OptionError(f"argument --scores: expected float [heads, tokens, blocks], got "
                          f"{scores.dtype} {scores.shape}")
    if seq_lens.ndim != 1 or seq_lens.dtype.kind not in "iu":
        raise OptionError(f"argument --seq-lens: expected integer [requests], got "
                          f"{seq_lens.dtype} {seq_lens.shape}")
    if scores.shape[1] != seq_lens.size * query_len:
        raise OptionError(f"argument --seq-lens: {seq_lens.size} requests x --query-len "
                          f"{query_len} != {scores.shape[1]} tokens in --scores")
    if not 1 <= scores.shape[2] < MAX_GLOBAL_BLOCKS:
        raise OptionError(f"argument --scores: {scores.shape[2]} blocks; expected 1 to "
                          f"{MAX_GLOBAL_BLOCKS - 1}")
    return scores.astype(np.float32, copy=False), seq_lens.astype(np.int32, copy=False)


def _check_package_choices(args) -> None:
    """What the package itself would reject later: the kernel family for topk, and the
    transport (option or environment) for the arrays this backend exchanges."""
    from .comm import base, choose, gpu_aware, ipc
    from .ops import choose_method

    try:
        choose_method(args.method, args.topk)
    except ValueError as exc:
        raise OptionError(f"argument --method: {exc}") from None
    if args.transport is not None:
        takes_device = choose.TRANSPORTS[args.transport].device
        if TARGET.name != "sim" and not takes_device:
            raise OptionError(f"argument --transport: {args.transport} moves host NumPy "
                              f"arrays; the {TARGET.name} backend exchanges device arrays")
    else:  # NUMBA_CP_TRANSPORT, checked as the plan will check it
        device = not TARGET.simulator or bool(choose.takes_device_arrays(None))
        try:
            choose.checked_request(None, device)
        except ValueError as exc:
            raise OptionError(str(exc)) from None
    try:
        base.collective_timeout()
        ipc.timeout_from_env()
        ipc.wait_setting()
        gpu_aware._env_flag(gpu_aware.GPU_AWARE_ENV)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def check_with_world(args, world: int, contexts_config) -> None:
    """The checks that need the world size; the same verdict on every rank.

    ``contexts_config(context)`` builds the ExchangeConfig of one context (it
    raises ValueError or TypeError naming the field).
    """
    if args.fail_rank is not None and args.fail_rank >= world:
        raise OptionError(f"argument --fail-rank: {args.fail_rank} is not a rank of this "
                          f"world of {world}")
    if args.hierarchy == "node":
        from .nodes import sizes_from_env

        try:
            sizes_from_env(world)
        except ValueError as exc:
            raise OptionError(str(exc)) from None
    for context in args.contexts:
        try:
            contexts_config(context)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"context {context}, world {world}: {exc}") from None
