"""Compile every kernel for a real GPU target without a GPU.

    NUMBA_CP_BACKEND=cuda NUMBA_CP_COMPILE_ONLY=1 python -m numba_cp.compile_check

builds PTX for sm_90 (``--cc`` picks others) through ``numba.cuda.compile_ptx``
and prints a table, one line per kernel specialisation. The simulator accepts
code that real targets reject (types, unsupported calls); this catches that.
Exit status 1 if any kernel fails.

    NUMBA_CP_BACKEND=hip NUMBA_CP_COMPILE_ONLY=1 python -m numba_cp.compile_check \
        --target hip --arch gfx90a,gfx942 [--lld PATH]

does the same through numba-hip (``tools/rocm_compile_check.sh`` sets up the
toolchain on a CPU-only machine and runs it). Every specialisation is taken as
far as the toolchain goes, for every arch:

``IR``
    ``numba.hip.compile_llvm_ir``: the kernel typed, lowered and linked with
    numba-hip's HIP device library into one AMDGPU LLVM module.
``code object``
    that module verified, optimised (``default<O3>``) and compiled by the LLVM
    that numba-hip ships (its AMDGPU backend) into a relocatable ELF, linked by
    ``ld.lld -shared`` into an HSA code object, and checked: ELF64, ``EM_AMDGPU``
    (224), ``ET_DYN``, the arch in ``e_flags``, one kernel with its ``.kd``
    descriptor in the code object metadata. Needs ``ld.lld`` (``--lld``,
    ``$NUMBA_CP_LLD`` or PATH); without it the strongest level is ``IR``.

Exit status 1 if any kernel misses the strongest level the toolchain reaches.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from numba import types

from . import _numba
from .backend import TARGET, cuda
from .kernels.params import INTEGER, WORD, Address, Array

CAPACITIES = (16, 2048)  # the smallest sort tile the tests use and the envelope's largest
# (run, slots, warps) of the warp kernels: one-warp rows with in-lane and
# cross-lane stages, and multi-warp rows (chunk loop + shared-memory tree).
# Both fit a run in a warp of 32 (CUDA) and of 64 lanes (CDNA).
WARP_SHAPES = ((16, 2, 1), (128, 4, 8))
# (run, slots, threads, chunk) of the rank kernels: a row ranked in one chunk by
# two warps, and one of four chunks, two keys per thread, merged by run searches.
# Both fit a run in a warp of 32 and of 64 lanes.
RANK_SHAPES = ((16, 1, 64, 64), (32, 2, 128, 64))


def signature(kernel, integer=types.int32, word=types.uint64):
    """The Numba signature of ``kernel`` from its declared parameters.

    ``integer`` and ``word`` specialise the :data:`~numba_cp.kernels.params.INTEGER`
    and :data:`~numba_cp.kernels.params.WORD` placeholders.
    """
    chosen = {INTEGER: integer, WORD: word}
    args = []
    for param in _numba.kernel_py_func(kernel).params:
        if isinstance(param, Address):  # (data address, *shape)
            args.append(types.UniTuple(types.int64, param.ndim + 1))
        elif isinstance(param, Array):
            dtype = chosen.get(param.dtype) or getattr(types, param.dtype)
            args.append(types.Array(dtype, param.ndim, param.layout))
        else:
            args.append(types.int64)
    return types.void(*args)


def specialisations():
    """``(label, python function, signature)`` for every kernel the wrappers can launch."""
    from .kernels import ipc, radix, rank, warp
    from .kernels.shells import KERNELS, SMALL_ROW_KERNELS

    families = [(warp, "run={},slots={},warps={}".format(*shape), shape, (types.int32,))
                for shape in WARP_SHAPES]
    families += [(rank, "run={},slots={},threads={},chunk={}".format(*shape), shape,
                  (types.int32,)) for shape in RANK_SHAPES]
    families += [(radix, f"cap={capacity}", (capacity,), (types.int32, types.int64))
                 for capacity in CAPACITIES]
    for family, shape_label, shape, integers in families:
        factories = KERNELS if family is radix else KERNELS + SMALL_ROW_KERNELS
        for integer in integers:
            label = shape_label if len(integers) == 1 else f"{shape_label},seq_lens={integer}"
            for factory in factories:
                kernel = getattr(family, factory)(*shape)
                name = _numba.kernel_py_func(kernel).__name__
                yield f"{name}[{label}]", kernel.py_func, signature(kernel, integer)
    for kernel in (ipc.ipc_bump_kernel, ipc.ipc_push_kernel, ipc.ipc_wait_copy_kernel,
                   ipc.ipc_wait_kernel):
        name = _numba.kernel_py_func(kernel).__name__.replace("_kernel", "")
        moves_words = kernel in (ipc.ipc_push_kernel, ipc.ipc_wait_copy_kernel)
        words = (types.uint64, types.uint8) if moves_words else (None,)
        for word in words:
            label = f"{name}[unit={word}]" if word is not None else f"{name}[ctrl=int64]"
            yield label, kernel.py_func, signature(kernel, word=word)


def _chosen(only):
    """The specialisations whose label contains ``only`` (all for ``None``)."""
    return [s for s in specialisations() if only is None or only in s[0]]


def compile_all(cc=(9, 0), only=None):
    """Yield ``(label, ok, seconds, detail)`` per specialisation."""
    with _numba.stand_in_device("cuda", compute_capability=cc):
        yield from _compile_each(cc, only)


def _compile_each(cc, only):
    for label, pyfunc, sig in _chosen(only):
        start = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=cc)
        except Exception as exc:  # report every kernel, not just the first failure
            yield label, False, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
        else:
            local = sum(int(n) for n in re.findall(r"\.local \.align \d+ \.b8 \S+\[(\d+)\]", ptx))
            detail = f"{len(ptx)} bytes of PTX, {local} B local memory"
            if ("_warp[" in label or "_rank[" in label) and local:  # keys stay in registers
                yield label, False, time.perf_counter() - start, detail + " (expected none)"
            elif "bar.red." in ptx:  # kernels/primitives.py, block_any: such a vote hung
                yield label, False, time.perf_counter() - start, detail + ", a block vote"
            else:
                yield label, True, time.perf_counter() - start, detail


# ---------------------------------------------------------------------------
# HIP (numba-hip): LLVM IR, then an AMDGPU code object


EM_AMDGPU = 224
ET_DYN = 3
ELFOSABI_AMDGPU_HSA = 64
EF_AMDGPU_MACH_MASK = 0x0FF
# llvm/BinaryFormat/ELF.h, EF_AMDGPU_MACH_AMDGCN_*
EF_AMDGPU_MACH = {"gfx908": 0x030, "gfx90a": 0x03F, "gfx940": 0x040, "gfx941": 0x04B,
                  "gfx942": 0x04C, "gfx950": 0x04F}
_XNACK = {0x000: "xnack unsupported", 0x100: "xnack any", 0x200: "xnack off", 0x300: "xnack on"}
_SRAMECC = {0x000: "sramecc unsupported", 0x400: "sramecc any", 0x800: "sramecc off",
            0xC00: "sramecc on"}
# e_ident[EI_ABIVERSION] of an HSA code object: 2 = v4, 3 = v5, 4 = v6
_CODE_OBJECT_VERSION = {2: "v4", 3: "v5", 4: "v6"}
LEVELS = ("IR", "code object")


def _target_arch(arch):
    """Let device functions compile for ``arch`` with no GPU present."""
    return _numba.stand_in_device("hip", amdgpu_arch=arch)


def _find_lld(explicit=None):
    for candidate in (explicit, os.environ.get("NUMBA_CP_LLD"), shutil.which("ld.lld")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def check_code_object(data: bytes, arch: str) -> str:
    """Raise ValueError unless ``data`` is an HSA code object (ELF DSO) for ``arch``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    (e_flags,) = struct.unpack_from("<I", data, 48)
    if e_machine != EM_AMDGPU:
        raise ValueError(f"e_machine {e_machine}, expected EM_AMDGPU ({EM_AMDGPU})")
    if e_type != ET_DYN:
        raise ValueError(f"e_type {e_type}, expected ET_DYN ({ET_DYN})")
    if data[7] != ELFOSABI_AMDGPU_HSA:
        raise ValueError(f"EI_OSABI {data[7]}, expected ELFOSABI_AMDGPU_HSA (64)")
    mach = EF_AMDGPU_MACH.get(arch.split(":")[0])
    if mach is not None and e_flags & EF_AMDGPU_MACH_MASK != mach:
        raise ValueError(f"e_flags {e_flags:#x}: machine {e_flags & EF_AMDGPU_MACH_MASK:#x}, "
                         f"expected {mach:#x} for {arch}")
    name = arch if mach is not None else f"machine {e_flags & EF_AMDGPU_MACH_MASK:#x} unchecked"
    version = _CODE_OBJECT_VERSION.get(data[8], f"abi {data[8]}")
    return (f"e_flags {e_flags:#x} ({name}, {_XNACK.get(e_flags & 0x300, '?')}, "
            f"{_SRAMECC.get(e_flags & 0xC00, '?')}), code object {version}")


def _kernel_resources(data: bytes) -> str:
    """Registers, LDS and scratch of the one kernel, from the code object metadata."""
    from rocm import comgr

    metadata = comgr.parse_code_obj_metadata(data, len(data))
    kernels = metadata["amdhsa.kernels"]
    if len(kernels) != 1 or not str(kernels[0][".symbol"]).endswith(".kd"):
        raise ValueError(f"expected one kernel with a .kd descriptor, found {len(kernels)}")
    k = kernels[0]
    return (f"{k['.vgpr_count']} VGPR, {k['.sgpr_count']} SGPR, "
            f"{k['.group_segment_fixed_size']} B LDS, {k['.private_segment_fixed_size']} B "
            f"scratch, spills {k['.vgpr_spill_count']} VGPR / {k['.sgpr_spill_count']} SGPR")


class _CodeObjectBuilder:
    """LLVM IR -> relocatable ELF (numba-hip's LLVM) -> code object (ld.lld)."""

    def __init__(self, lld, workdir):
        from rocm.bindings.llvm.c.target import LLVMInitializeAllAsmPrinters

        LLVMInitializeAllAsmPrinters()  # numba.hip.amdgcn initialises targets, not printers
        self.lld = lld
        self.workdir = workdir

    def build(self, llvm_ir: str, arch: str, stem: str) -> bytes:
        import ctypes

        from numba.hip import amdgcn
        from rocm.bindings.llvm.c.core import LLVMContextCreate, LLVMContextDispose
        from rocm.bindings.llvm.c.targetmachine import (
            LLVMCodeGenFileType,
            LLVMTargetMachineEmitToFile,
        )

        relocatable = os.path.join(self.workdir, stem + ".o")
        code_object = os.path.join(self.workdir, stem + ".hsaco")
        machine = amdgcn.AMDGPUTargetMachine(arch)
        context = LLVMContextCreate()
        try:
            module = _numba.llvm_module_in_context(context, llvm_ir)
            machine.optimize_module(module, passes="default<O3>")  # verifies the module first
            error = ctypes.c_char_p()
            failed = LLVMTargetMachineEmitToFile(
                _numba.target_machine_handle(machine), module, relocatable.encode(),
                LLVMCodeGenFileType.LLVMObjectFile, ctypes.addressof(error))
            if failed:
                raise RuntimeError(f"LLVM AMDGPU codegen failed: {(error.value or b'').decode()}")
        finally:
            LLVMContextDispose(context)
        proc = subprocess.run([self.lld, "-shared", "--no-undefined", "-o", code_object,
                               relocatable], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ld.lld failed: {(proc.stderr or proc.stdout).strip()}")
        with open(code_object, "rb") as f:
            return f.read()


def _safe_stem(label, arch):
    return arch + "-" + "".join(c if c.isalnum() or c in "-_=" else "_" for c in label)


def compile_all_hip(archs=("gfx90a", "gfx942"), lld=None, keep=None, only=None):
    """Yield ``(label, arch, level reached or None, seconds, detail)`` per specialisation."""
    workdir = keep or tempfile.mkdtemp(prefix="numba_cp_hip_")
    os.makedirs(workdir, exist_ok=True)
    builder = _CodeObjectBuilder(lld, workdir) if lld else None
    try:
        for arch in archs:
            with _target_arch(arch):
                for label, pyfunc, sig in _chosen(only):
                    yield (label, arch) + _compile_one_hip(label, pyfunc, sig, arch,
                                                            builder, keep)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _compile_one_hip(label, pyfunc, sig, arch, builder, keep):
    start = time.perf_counter()
    try:
        llvm_ir, _ = cuda.compile_ptx(pyfunc, sig, cc=arch)
        cpu = arch.split(":")[0]  # gfx90a:xnack- targets cpu gfx90a
        if "amdgpu_kernel" not in llvm_ir or f'"target-cpu"="{cpu}"' not in llvm_ir:
            raise ValueError(f"the LLVM IR has no amdgpu_kernel for target-cpu {cpu}")
    except Exception as exc:  # report every kernel, not just the first failure
        return None, time.perf_counter() - start, f"IR: {type(exc).__name__}: {_first_line(exc)}"
    stem = _safe_stem(label, arch)
    if keep:
        with open(os.path.join(keep, stem + ".ll"), "w") as f:
            f.write(llvm_ir)
    detail = f"{len(llvm_ir)} B of LLVM IR"
    if builder is None:
        return "IR", time.perf_counter() - start, detail
    try:
        data = builder.build(llvm_ir, arch, stem)
        elf = check_code_object(data, arch)
        resources = _kernel_resources(data)
    except Exception as exc:
        return "IR", time.perf_counter() - start, (
            f"{detail}; code object: {type(exc).__name__}: {_first_line(exc)}")
    return "code object", time.perf_counter() - start, f"{len(data)} B, {elf}; {resources}"


def _first_line(exc, limit=300):
    """The first informative line of an error (past numba's "Failed in ... pipeline")."""
    lines = [part.strip() for part in str(exc).strip().splitlines() if part.strip()]
    line = next((part for part in lines if not part.startswith("Failed in ")),
                lines[0] if lines else "")
    return line if len(line) <= limit else line[:limit] + "..."


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def _hip_versions(lld):
    from importlib import metadata

    import llvmlite
    import numba
    from rocm.bindings import amd_comgr
    from rocm.bindings.llvm.config import llvm_config

    def dist(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "?"

    _, major, minor = amd_comgr.amd_comgr_get_version()
    llvm = _text(llvm_config.LLVM_VERSION_STRING)
    parts = [f"numba {numba.__version__}", f"numba-hip {dist('numba-hip')}",
             f"llvmlite {llvmlite.__version__}",
             f"rocm-bindings {dist('rocm-bindings-compiler')} (LLVM {llvm})",
             f"comgr API {major}.{minor}"]
    if lld:
        proc = subprocess.run([lld, "--version"], capture_output=True, text=True)
        lines = (proc.stdout or proc.stderr or "ld.lld ?").strip().splitlines()
        parts.append(lines[0] if lines else "ld.lld ?")
    return ", ".join(parts)


def _comgr_probe(arch):
    """numba-hip's own code-object path (comgr) on one kernel, for the record."""
    label, pyfunc, sig = next(iter(specialisations()))
    with _target_arch(arch):
        llvm_ir, _ = cuda.compile_ptx(pyfunc, sig, cc=arch)
    try:
        _numba.comgr_compile(llvm_ir, arch)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines()]
        reason = next((line for line in lines if line.startswith("error:")), _first_line(exc))
        return f"comgr CODEGEN_BC_TO_RELOCATABLE on {label} for {arch}: failed: {reason}"
    return f"comgr CODEGEN_BC_TO_RELOCATABLE on {label} for {arch}: ok"


def main_hip(args) -> int:
    if TARGET.name != "hip":
        print(f"compile_check --target hip needs NUMBA_CP_BACKEND=hip (with "
              f"NUMBA_CP_COMPILE_ONLY=1 on a machine with no GPU); the active backend is "
              f"{TARGET.name}", file=sys.stderr)
        return 2
    archs = tuple(a.strip() for a in args.arch.split(",") if a.strip())
    lld = _find_lld(args.lld)
    strongest = "code object" if lld else "IR"
    print(f"toolchain: {_hip_versions(lld)}")
    if not lld:
        print("no ld.lld (--lld, $NUMBA_CP_LLD or PATH): the strongest level is LLVM IR")
    print(f"{'kernel':<52} {'arch':<7} {'level':<12} {'result':<6} {'s':>6}  detail")
    failures = 0
    for label, arch, level, seconds, detail in compile_all_hip(archs, lld, args.keep,
                                                               args.only):
        ok = level is not None and LEVELS.index(level) >= LEVELS.index(strongest)
        failures += not ok
        print(f"{label:<52} {arch:<7} {level or '-':<12} {'ok' if ok else 'FAIL':<6} "
              f"{seconds:6.2f}  {detail}", flush=True)
    count = len(archs) * len(_chosen(args.only))
    print(f"{count - failures} of {count} kernel x arch compiles reached {strongest}")
    if args.probe_comgr and archs:
        print(f"numba-hip's own code-object path: {_comgr_probe(archs[-1])}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("cuda", "hip"), default="cuda",
                        help="cuda: PTX through numba-cuda (default); hip: numba-hip")
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 or 8.0")
    parser.add_argument("--arch", default="gfx90a,gfx942",
                        help="--target hip: comma-separated AMD GPU archs")
    parser.add_argument("--lld", default=None,
                        help="--target hip: ld.lld to link code objects (default $NUMBA_CP_LLD, "
                             "then PATH)")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="--target hip: keep the .ll, .o and .hsaco files in DIR")
    parser.add_argument("--probe-comgr", action="store_true",
                        help="--target hip: also try numba-hip's own comgr code-object path "
                             "on one kernel and report the outcome (it never fails the check)")
    parser.add_argument("--only", metavar="TEXT", default=None,
                        help="compile only the kernels whose label contains TEXT")
    args = parser.parse_args(argv)
    if args.target == "hip":
        return main_hip(args)
    if TARGET.name != "cuda":
        print(f"compile_check needs NUMBA_CP_BACKEND=cuda (with NUMBA_CP_COMPILE_ONLY=1 on a "
              f"machine with no GPU); the active backend is {TARGET.name}", file=sys.stderr)
        return 2
    cc = tuple(int(part) for part in args.cc.split("."))
    failures = 0
    print(f"{'kernel':<52} {'sm':>4} {'result':<6} {'s':>6}  detail")
    for label, ok, seconds, detail in compile_all(cc, args.only):
        failures += not ok
        print(f"{label:<52} {cc[0]}{cc[1]:<3} {'ok' if ok else 'FAIL':<6} {seconds:6.2f}  {detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
