"""Every kernel (the IPC all-gather's too) compiles for a real GPU (sm_90 PTX) with no GPU.

The simulator runs kernels as Python and accepts code that real targets reject;
numba-cuda's compiler (NVVM, from the CUDA toolkit wheels) catches that, and
nvJitLink assembles the IPC kernels' inline PTX into SASS.

The CPU-only environment installs no toolkit wheels (about 0.5 GB), so these tests
use NVVM where the environment has it (the cuda extras) and otherwise, with
``NUMBA_CP_PTX_CHECK=1`` (CI sets it), ``tools/ptx_compile_check.sh``, which
builds an environment of its own; without either they skip, saying why.
"""

import importlib.util
import os
import subprocess
import sys
from functools import lru_cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_NVVM = ("this environment cannot compile for NVIDIA GPUs: the CPU-only setup leaves out "
           "numba-cuda[cu13]'s CUDA toolkit wheels (NVVM, NVRTC); NUMBA_CP_PTX_CHECK=1 runs "
           "this check in .venv-ptx-check (tools/ptx_compile_check.sh, about 0.5 GB of "
           "downloads)")


def _compile_only_env():
    env = dict(os.environ, NUMBA_CP_BACKEND="cuda", NUMBA_CP_COMPILE_ONLY="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


# A one-line kernel compiled to PTX: a system CUDA may have NVVM but not NVRTC, which
# numba-cuda needs as well.
_PROBE = """
from numba import types
from numba_cp._numba import stand_in_device
from numba_cp.backend import cuda
def kernel(out):
    out[0] = 1
with stand_in_device("cuda", compute_capability=(9, 0)):
    cuda.compile_ptx(kernel, (types.int64[:],), cc=(9, 0))
"""


@lru_cache(maxsize=None)
def _compiler_here() -> bool:
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=_compile_only_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode == 0


def run_with_nvvm(*python_args, timeout):
    """``python *python_args`` where numba-cuda can compile (NVVM and NVRTC), in
    compile-only mode; skips if nowhere."""
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda is not installed (an AMD-only environment)")
    if _compiler_here():
        command = [sys.executable, *python_args]
    elif os.environ.get("NUMBA_CP_PTX_CHECK") == "1":
        command = ["bash", "tools/ptx_compile_check.sh", *python_args]
    else:
        pytest.skip(NO_NVVM)
    proc = subprocess.run(command, env=_compile_only_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode == 3 and command[0] == "bash":  # the wheels could not be fetched
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    return proc


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_kernel_compiles_to_ptx_for_sm90():
    proc = run_with_nvvm("-m", "numba_cp.compile_check", "--cc", "9.0", timeout=1100)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "[cap=" in line]
    # 2 sort tiles x 2 seq_lens dtypes x 10 kernels (pack, merge, merge + table, merge to
    # keys, world 1's one kernel with and without the table; the fused exchange's three and
    # the fused node level's merge to keys)
    assert len(lines) == 40 and all(" ok " in line for line in lines), proc.stdout
    # two shapes x 12 kernels (the ten, the pack and merge + table over arrays by address)
    warp = [line for line in proc.stdout.splitlines() if "_warp[" in line]
    assert len(warp) == 24, proc.stdout  # register-only: a local-memory depot fails the line
    assert all(" ok " in line and " 0 B local memory" in line for line in warp), proc.stdout
    rank = [line for line in proc.stdout.splitlines() if "_rank[" in line]
    assert len(rank) == 24, proc.stdout  # register-only too
    assert all(" ok " in line and " 0 B local memory" in line for line in rank), proc.stdout
    ipc = [line for line in proc.stdout.splitlines() if line.startswith("ipc_")]
    assert len(ipc) == 6 and all(" ok " in line for line in ipc), proc.stdout  # IPC all-gather


def run_assembling(code):
    """``python -c code`` where numba-cuda compiles and nvJitLink assembles (skips if
    libnvJitLink cannot be loaded); fails the test if it exits non-zero."""
    proc = run_with_nvvm("-c", code, timeout=800)
    if proc.returncode and "nvjitlink" in proc.stderr.lower() and (
            "not found" in proc.stderr.lower() or "no module" in proc.stderr.lower()):
        pytest.skip("libnvJitLink is not loadable")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# The memory-model instructions each IPC kernel must keep after NVVM (the protocol in
# numba_cp.kernels.ipc relies on them), then ptxas's job done by nvJitLink; the fused
# exchange's kernels for one shape of each family too.
_ASSEMBLE = """
import sys
from numba import types
from cuda.bindings import nvjitlink as J
from numba_cp._numba import stand_in_device
from numba_cp.backend import cuda
from numba_cp.compile_check import specialisations
SIGNAL = (b"st.release.sys", b"membar.sys")
WAIT = (b"ld.acquire.sys", b"membar.sys", b"nanosleep")
NEEDS = {"ipc_push": SIGNAL, "ipc_wait_copy": WAIT, "ipc_bump": (), "ipc_wait": WAIT,
         "shard_topk_keys_to_peers_warp": SIGNAL, "merge_delivered_topk_ids_warp": WAIT,
         "merge_delivered_topk_ids_and_table_warp": WAIT, "shard_topk_keys_to_peers": SIGNAL,
         "merge_delivered_topk_ids": WAIT, "merge_delivered_topk_ids_and_table": WAIT,
         "merge_delivered_topk_keys_warp": WAIT, "merge_delivered_topk_keys": WAIT,
         "shard_topk_keys_to_peers_rank": SIGNAL, "merge_delivered_topk_ids_rank": WAIT,
         "merge_delivered_topk_ids_and_table_rank": WAIT, "merge_delivered_topk_keys_rank": WAIT}
FUSED_SHAPES = ("[run=16,slots=2,warps=1]", "[run=16,slots=1,threads=64,chunk=64]",
                "[cap=16,seq_lens=int32]")
with stand_in_device("cuda", compute_capability=(9, 0)):
    for label, fn, sig in specialisations():
        name = label.split("[")[0]
        if name not in NEEDS or not (name.startswith("ipc_") or label.endswith(FUSED_SHAPES)):
            continue
        ptx = cuda.compile_ptx(fn, sig, cc=(9, 0))[0].encode()
        for needle in NEEDS[name]:
            if needle not in ptx:
                sys.exit(f"{label}: no {needle.decode()} in the PTX")
        options = ["-arch=sm_90"]
        h = J.create(len(options), options)
        J.add_data(h, J.InputType.PTX, ptx, len(ptx), label)
        J.complete(h)
        print(label, J.get_linked_cubin_size(h))
        J.destroy(h)
"""


@pytest.mark.timeout(900)
def test_ipc_kernels_assemble_for_sm90():
    """compile_ptx does not run ptxas: nvJitLink turns the PTX into SASS here."""
    proc = run_assembling(_ASSEMBLE)
    labels = [line.split()[0] for line in proc.stdout.splitlines()]
    fused = [f"{name}{shape}" for shape, suffix in (
                 ("[run=16,slots=2,warps=1]", "_warp"),
                 ("[run=16,slots=1,threads=64,chunk=64]", "_rank"),
                 ("[cap=16,seq_lens=int32]", ""))
             for name in ("shard_topk_keys_to_peers", "merge_delivered_topk_ids",
                          "merge_delivered_topk_ids_and_table", "merge_delivered_topk_keys")
             for name in [name + suffix]]
    assert labels == fused + [
        "ipc_bump[ctrl=int64]", "ipc_push[unit=uint64]", "ipc_push[unit=uint8]",
        "ipc_wait_copy[unit=uint64]", "ipc_wait_copy[unit=uint8]", "ipc_wait[ctrl=int64]"], \
        proc.stdout
    assert all(int(line.split()[1]) > 0 for line in proc.stdout.splitlines()), proc.stdout


# Every chained kernel (numba_cp.launcher's chained launches) in sm_90 PTX: the first
# memory instruction that is not a parameter read comes after griddepcontrol.wait, there
# is no early trigger of the next launch (kernels/primitives.py says why), and nvJitLink
# assembles it; for sm_80, which has no griddepcontrol, the PTX has none.
_CHAINED = r"""
import re, sys
from cuda.bindings import nvjitlink as J
from numba_cp._numba import stand_in_device
from numba_cp.backend import cuda
from numba_cp.compile_check import specialisations
SHAPES = ("[run=16,slots=2,warps=1]", "[run=16,slots=1,threads=64,chunk=64]",
          "[cap=16,seq_lens=int32]")
MEMORY = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp\.async|prefetch)\.(?!param)",
                    re.M)
chained = [(label, fn, sig) for label, fn, sig in specialisations()
           if getattr(fn, "chained", False)
           and (label.endswith(SHAPES) or label.startswith("ipc_"))]
if len(chained) != 40:  # ten kernels of each family, the warp and rank families'
    # pack and merge + table over arrays by address, six IPC specialisations
    sys.exit(f"{len(chained)} chained kernels at the checked shapes: "
             f"{[label for label, _, _ in chained]}")
for label, fn, sig in chained:
    with stand_in_device("cuda", compute_capability=(9, 0)):
        ptx = cuda.compile_ptx(fn, sig, cc=(9, 0))[0]
    wait = ptx.find("griddepcontrol.wait;")
    first = MEMORY.search(ptx)
    if wait < 0:
        sys.exit(f"{label}: no griddepcontrol.wait in its sm_90 PTX")
    if "griddepcontrol.launch_dependents;" in ptx:  # the next grid launches as this one ends
        sys.exit(f"{label}: triggers the next launch early (griddepcontrol.launch_dependents)")
    if first is not None and first.start() < wait:
        sys.exit(f"{label}: {first.group(0).strip()!r} comes before griddepcontrol.wait")
    options = ["-arch=sm_90"]
    h = J.create(len(options), options)
    J.add_data(h, J.InputType.PTX, ptx.encode(), len(ptx.encode()), label)
    J.complete(h)
    J.destroy(h)
    print(label, "waits first")
label, fn, sig = chained[0]
with stand_in_device("cuda", compute_capability=(8, 0)):
    if "griddepcontrol" in cuda.compile_ptx(fn, sig, cc=(8, 0))[0]:
        sys.exit(f"{label}: griddepcontrol in its sm_80 PTX")
print("sm_80: none")
"""


@pytest.mark.timeout(900)
def test_chained_kernels_wait_before_touching_memory_in_sm90_ptx():
    proc = run_assembling(_CHAINED)
    assert proc.stdout.count("waits first") == 40 and "sm_80: none" in proc.stdout, proc.stdout


# The pack's and the merge + table kernels' parameter lists in sm_90 PTX, at case g's
# merge shape (rank) and a one-warp row (warp): Numba's array structs against arrays by
# address and shape.
_PARAMS = r"""
import re
from numba_cp._numba import stand_in_device
from numba_cp.backend import cuda
from numba_cp.compile_check import signature
from numba_cp.kernels import rank, warp
for family, shape in ((rank, (32, 1, 128, 32)), (warp, (32, 2, 1))):
    for factory in (family.pack_kernel, family.pack_addressed_kernel,
                    family.merge_table_kernel, family.merge_table_addressed_kernel):
        kernel = factory(*shape)
        with stand_in_device("cuda", compute_capability=(9, 0)):
            ptx = cuda.compile_ptx(kernel.py_func, signature(kernel), cc=(9, 0))[0]
        start = ptx.index(".entry")
        entry = ptx[start:ptx.index(")", start)]
        words = re.findall(r"\.param\s+\.(\w+)\s", entry)
        print(kernel.py_func.__name__, len(words), *sorted(set(words)))
"""


@pytest.mark.timeout(600)
def test_kernels_by_address_take_fewer_parameter_words():
    """The pack: 36 words with Numba's three array structs, 17 with each array as its
    address and shape; the merge + table: 64 and 25 (the README's "Arrays by address")."""
    proc = run_with_nvvm("-c", _PARAMS, timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert lines == [[f"{kernel}_{family}", words, "u64"] for family in ("rank", "warp")
                     for kernel, words in (("shard_topk_keys", "36"),
                                           ("shard_topk_keys_addressed", "17"),
                                           ("merge_topk_ids_and_table", "64"),
                                           ("merge_topk_ids_and_table_addressed", "25"))], \
        proc.stdout


def test_compile_check_fails_a_kernel_that_votes_at_a_barrier(monkeypatch):
    """A barrier vote in a kernel's PTX (Numba's syncthreads_or and kin: ``bar.red``)
    fails its line, whatever its family; a plain barrier does not. No compiler needed:
    the PTX is given."""
    from numba_cp import compile_check

    ptx = {"votes": "bar.sync \t0;\n\tbar.red.or.pred \t%p3, 0, %p2;\n",
           "waits": "bar.sync \t0;\n\tld.shared.u64 \t%rd4, [%rd3];\n"}

    class Compiler:
        @staticmethod
        def compile_ptx(pyfunc, sig, cc):
            return ptx[pyfunc], None

    monkeypatch.setattr(compile_check, "cuda", Compiler)
    monkeypatch.setattr(compile_check, "_chosen", lambda only: [
        ("merge_topk_ids_rank[votes]", "votes", None), ("ipc_wait[votes]", "votes", None),
        ("merge_topk_ids_rank[waits]", "waits", None)])
    lines = {label: (ok, detail)
             for label, ok, _, detail in compile_check._compile_each((9, 0), None)}
    assert lines["merge_topk_ids_rank[votes]"] == (False, f"{len(ptx['votes'])} bytes of PTX, "
                                                          "0 B local memory, a block vote")
    assert not lines["ipc_wait[votes]"][0]
    assert lines["merge_topk_ids_rank[waits]"][0]
