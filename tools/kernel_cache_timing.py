"""The start-up time the on-disk kernel cache saves, measured without a GPU.

    bash tools/ptx_compile_check.sh tools/kernel_cache_timing.py [--only warp]
    (or: NUMBA_CP_BACKEND=cuda NUMBA_CP_COMPILE_ONLY=1 python tools/kernel_cache_timing.py
     in an environment with the CUDA toolkit's NVVM, such as the cuda extra's)

For every pack and merge kernel the package launches (numba_cp.compile_check's list,
the IPC all-gather's kernels aside), one fresh process compiles it as a first launch
does (NVVM, then nvJitLink to an sm_90 cubin) and saves it through
numba_cp.kernel_cache into an empty folder; a second fresh process, as a later rank
or job would, loads it from there. Prints both times per kernel and the totals. On a
GPU, a launch adds the same module load to either path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CC = (9, 0)


def phase(name: str, only: str | None) -> None:
    from numba_cp import _numba, compile_check, kernel_cache
    from numba_cp.backend import cuda

    with _numba.stand_in_context(CC):
        for label, pyfunc, signature in compile_check.specialisations():
            if label.startswith("ipc_") or (only and only not in label):
                continue
            dispatcher = cuda.jit(pyfunc)  # the cache is keyed by the Python function
            if not kernel_cache.use_disk_cache(dispatcher):
                sys.exit(f"{label}: the disk cache could not be enabled")
            start = time.perf_counter()
            if name == "compile":
                _numba.compile_for_cache(dispatcher, signature, CC)
                found = True
            else:
                found = _numba.load_from_cache(dispatcher, signature) is not None
            print(f"{label} {time.perf_counter() - start:.4f} {found}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="kernels whose label contains this")
    p.add_argument("--phase", choices=("compile", "load"), default=None,
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        phase(args.phase, args.only)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, NUMBA_CP_KERNEL_CACHE=folder, NUMBA_CP_BACKEND="cuda",
                   NUMBA_CP_COMPILE_ONLY="1")
        for name in ("compile", "load"):
            command = [sys.executable, __file__, "--phase", name]
            if args.only:
                command += ["--only", args.only]
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout + proc.stderr, file=sys.stderr)
                return 1
            results[name] = [line.split() for line in proc.stdout.splitlines()]
    print(f"{'kernel':<62}{'compile s':>10}{'load s':>10}")
    misses = 0
    for (label, compiled, _), (_, loaded, found) in zip(results["compile"], results["load"]):
        misses += found != "True"
        print(f"{label:<62}{float(compiled):>10.2f}{float(loaded):>10.3f}"
              + ("" if found == "True" else "  (not in the cache)"))
    total = [sum(float(row[1]) for row in results[name]) for name in ("compile", "load")]
    print(f"{len(results['compile'])} kernels: compile {total[0]:.1f} s, load {total[1]:.2f} s, "
          f"{misses} not found in the cache")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
