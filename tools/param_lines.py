"""The small-row kernels' SASS with their arrays as Numba's structs and by address,
measured without a GPU: instructions, and the constant-bank lines their parameters sit on.

    bash tools/ptx_compile_check.sh tools/param_lines.py [--family rank|warp] [--shape S]

Each kernel is compiled as a first launch does (NVVM to sm_90 PTX, nvJitLink to a
cubin) and disassembled with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, fetched
into the environment on first use, or any ``nvdisasm`` on PATH). A kernel reads its
parameters from constant bank 0 (``c[0x0][...]``); the first read of each 64-byte line
by an SM waits on the constant cache, so the lines a kernel touches are what a
small-row launch waits on. By default: case b's pack (64 rows of 256 candidates, topk
16) and case g's merge + table (64 rows of 128 candidates, topk 32) at the shapes
``method="auto"`` launches them with (the rank family); ``--family`` and ``--shape``
(rank: run,slots,threads,chunk; warp: run,slots,warps) pick one shape for both kernels.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

LINE_BYTES = 64
CONSTANT = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/")


def nvdisasm() -> str:
    found = shutil.which("nvdisasm") or _in_prefix()
    if found:
        return found
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "nvidia-cuda-nvdisasm"], check=True)
    found = _in_prefix()
    if not found:
        raise SystemExit("param_lines: no nvdisasm after installing nvidia-cuda-nvdisasm")
    return found


def _in_prefix():
    hits = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia",
                                  "*", "bin", "nvdisasm"))
    return hits[0] if hits else None


def cubin(kernel) -> bytes:
    from cuda.bindings import nvjitlink

    from numba_cp import _numba, compile_check
    from numba_cp.backend import cuda

    with _numba.stand_in_device("cuda", compute_capability=(9, 0)):
        ptx, _ = cuda.compile_ptx(kernel.py_func, compile_check.signature(kernel), cc=(9, 0))
    options = ["-arch=sm_90"]
    handle = nvjitlink.create(len(options), options)
    data = ptx.encode()
    nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
    nvjitlink.complete(handle)
    image = bytearray(nvjitlink.get_linked_cubin_size(handle))
    nvjitlink.get_linked_cubin(handle, image)
    nvjitlink.destroy(handle)
    return bytes(image)


def summary(sass: str) -> tuple[int, list[int], list[int]]:
    """``(instructions, parameter-bank offsets read, 64-byte lines read)``."""
    instructions = sum(1 for line in sass.splitlines() if INSTRUCTION.search(line))
    offsets = sorted({int(m, 16) for m in CONSTANT.findall(sass)})
    return instructions, offsets, sorted({offset // LINE_BYTES for offset in offsets})


def case_shapes():
    """``[(label, factory, shape)]``: case b's pack and case g's merge + table as
    ``method="auto"`` launches them, each with Numba's arrays and by address."""
    from numba_cp import ops

    b_pack, b_shape, _ = ops._family(16, 256, "auto", None, None, merge=False, rows=64)
    g_merge, g_shape, _ = ops._family(32, 128, "auto", None, None, merge=True, rows=64)
    return [("b pack", b_pack.pack_kernel, b_shape),
            ("b pack", b_pack.pack_addressed_kernel, b_shape),
            ("g merge + table", g_merge.merge_table_kernel, g_shape),
            ("g merge + table", g_merge.merge_table_addressed_kernel, g_shape)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("rank", "warp"), default=None)
    parser.add_argument("--shape", default=None,
                        help="with --family: rank run,slots,threads,chunk; warp run,slots,warps")
    args = parser.parse_args(argv)
    from numba_cp.kernels import rank, warp

    if args.family is None:
        kernels = case_shapes()
    else:
        family = {"rank": rank, "warp": warp}[args.family]
        shape = tuple(int(n) for n in (args.shape or "32,1,128,32").split(","))
        kernels = [(f"{args.family} {shape}", factory, shape)
                   for factory in (family.pack_kernel, family.pack_addressed_kernel,
                                   family.merge_table_kernel,
                                   family.merge_table_addressed_kernel)]
    tool = nvdisasm()
    print("sm_90 SASS; lines: the 64-byte lines of constant bank 0 the kernel reads")
    print(f"{'what':<16} {'kernel':<42} {'shape':<18} {'instructions':>12} "
          f"{'param words':>11} {'lines':>5}")
    with tempfile.TemporaryDirectory() as folder:
        for label, factory, shape in kernels:
            kernel = factory(*shape)
            path = os.path.join(folder, "kernel.cubin")
            with open(path, "wb") as out:
                out.write(cubin(kernel))
            sass = subprocess.run([tool, "-c", path], capture_output=True, text=True,
                                  check=True).stdout
            instructions, offsets, lines = summary(sass)
            print(f"{label:<16} {kernel.py_func.__name__:<42} {str(shape):<18} "
                  f"{instructions:>12} {len(offsets):>11} {len(lines):>5}  {lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
