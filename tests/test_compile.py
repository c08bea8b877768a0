"""Every kernel (the IPC all-gather's too) compiles for a real GPU (sm_90 PTX) with no GPU.

The simulator runs kernels as Python and accepts code that real targets reject;
numba-cuda's compiler (NVVM, from the cuda-toolkit wheels) catches that, and
nvJitLink assembles the IPC kernels' inline PTX into SASS.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _numba_cuda_installed():
    return importlib.util.find_spec("numba_cuda") is not None


def _compile_only_env():
    env = dict(os.environ, NUMBA_CP_BACKEND="cuda", NUMBA_CP_COMPILE_ONLY="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _numba_cuda_installed(), reason="numba-cuda is not installed (an "
                    "AMD-only environment); the test extra installs numba-cuda[cu13]")
def test_every_kernel_compiles_to_ptx_for_sm90():
    proc = subprocess.run([sys.executable, "-m", "numba_cp.compile_check", "--cc", "9.0"],
                          env=_compile_only_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=540)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "[cap=" in line]
    # 2 sort tiles x 2 seq_lens dtypes x 6 kernels (pack, merge, merge + table; and the
    # fused exchange's three)
    assert len(lines) == 24 and all(" ok " in line for line in lines), proc.stdout
    warp = [line for line in proc.stdout.splitlines() if "_warp[" in line]
    assert len(warp) == 12, proc.stdout  # register-only: a local-memory depot fails the line
    assert all(" ok " in line and " 0 B local memory" in line for line in warp), proc.stdout
    ipc = [line for line in proc.stdout.splitlines() if line.startswith("ipc_")]
    assert len(ipc) == 6 and all(" ok " in line for line in ipc), proc.stdout  # IPC all-gather


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
         "merge_delivered_topk_ids": WAIT, "merge_delivered_topk_ids_and_table": WAIT}
FUSED_SHAPES = ("[run=16,slots=2,warps=1]", "[cap=16,seq_lens=int32]")
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


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _numba_cuda_installed(), reason="numba-cuda is not installed")
def test_ipc_kernels_assemble_for_sm90():
    """compile_ptx does not run ptxas: nvJitLink turns the PTX into SASS here."""
    if importlib.util.find_spec("cuda.bindings.nvjitlink") is None:
        pytest.skip("no cuda.bindings.nvjitlink")
    proc = subprocess.run([sys.executable, "-c", _ASSEMBLE], env=_compile_only_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    if proc.returncode and "nvJitLink" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("libnvJitLink is not loadable")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    labels = [line.split()[0] for line in proc.stdout.splitlines()]
    fused = [f"{name}{shape}" for shape, suffix in (("[run=16,slots=2,warps=1]", "_warp"),
                                                     ("[cap=16,seq_lens=int32]", ""))
             for name in ("shard_topk_keys_to_peers", "merge_delivered_topk_ids",
                          "merge_delivered_topk_ids_and_table")
             for name in [name + suffix]]
    assert labels == fused + [
        "ipc_bump[ctrl=int64]", "ipc_push[unit=uint64]", "ipc_push[unit=uint8]",
        "ipc_wait_copy[unit=uint64]", "ipc_wait_copy[unit=uint8]", "ipc_wait[ctrl=int64]"], \
        proc.stdout
    assert all(int(line.split()[1]) > 0 for line in proc.stdout.splitlines()), proc.stdout
