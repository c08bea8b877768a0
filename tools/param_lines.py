"""A merge + table kernel's SASS, with its arrays as Numba's structs and by address,
measured without a GPU: instructions, and the constant-bank lines its parameters sit on.

    bash tools/ptx_compile_check.sh tools/param_lines.py [--shape 32,1,128,32] [--family rank]

Each kernel is compiled as a first launch does (NVVM to sm_90 PTX, nvJitLink to a
cubin) and disassembled with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, fetched
into the environment on first use, or any ``nvdisasm`` on PATH). A kernel reads its
parameters from constant bank 0 (``c[0x0][...]``); the first read of each 64-byte line
by an SM waits on the constant cache, so the lines a kernel touches are what a
small-row launch waits on. The default shape is case g's merge + table (64 rows of 128
candidates, topk 32: the rank family, run 32, one key per thread, 128 threads).
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("rank", "warp"), default="rank")
    parser.add_argument("--shape", default="32,1,128,32",
                        help="the family's kernel shape: rank run,slots,threads,chunk; "
                             "warp run,slots,warps")
    args = parser.parse_args(argv)
    from numba_cp.kernels import rank, warp

    family = {"rank": rank, "warp": warp}[args.family]
    shape = tuple(int(n) for n in args.shape.split(","))
    tool = nvdisasm()
    print(f"sm_90 SASS, {args.family} family, shape {shape}")
    print(f"{'kernel':<45} {'instructions':>12} {'param words':>11} {'64-byte lines':>13}")
    with tempfile.TemporaryDirectory() as folder:
        for factory in (family.merge_table_kernel, family.merge_table_addressed_kernel):
            kernel = factory(*shape)
            path = os.path.join(folder, "kernel.cubin")
            with open(path, "wb") as out:
                out.write(cubin(kernel))
            sass = subprocess.run([tool, "-c", path], capture_output=True, text=True,
                                  check=True).stdout
            instructions, offsets, lines = summary(sass)
            print(f"{kernel.py_func.__name__:<45} {instructions:>12} {len(offsets):>11} "
                  f"{len(lines):>13}   lines {lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
