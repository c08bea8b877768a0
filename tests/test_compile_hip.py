"""Every kernel compiles through numba-hip for gfx90a and gfx942, on a machine with no GPU.

The real check is ``bash tools/rocm_compile_check.sh``: it builds its own venv
(numba-hip from PyPI) and ROCm prefix (Debian packages) and needs the network,
so it runs only with ``NUMBA_CP_HIP_CHECK=1``: about 40 s on a
2-core machine from nothing (downloads included), about 20 s once its venv and
prefix exist. The ELF checks it relies on are tested here on every run.
"""

import os
import re
import struct
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH_FLAGS = {"gfx90a": "e_flags 0x53f", "gfx942": "e_flags 0x54c"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("NUMBA_CP_HIP_CHECK") != "1",
                    reason="set NUMBA_CP_HIP_CHECK=1 to run tools/rocm_compile_check.sh (it "
                           "downloads numba-hip from PyPI and ROCm's compiler from Debian)")
def test_every_kernel_compiles_to_an_amdgpu_code_object():
    env = dict(os.environ, ARCH=",".join(ARCH_FLAGS))
    for var in ("NUMBA_CP_BACKEND", "NUMBA_ENABLE_CUDASIM", "NUMBA_CP_COMPILE_ONLY"):
        env.pop(var, None)
    proc = subprocess.run(["bash", "tools/rocm_compile_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1700)
    print(proc.stdout)
    if proc.returncode == 3:  # a registry or the network said no: nothing was compiled
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines()
            if "[cap=" in line.split(" ", 1)[0] and len(line.split()) > 2]
    assert len(rows) == 40 * len(ARCH_FLAGS), proc.stdout
    for arch, flags in ARCH_FLAGS.items():
        lines = [line for line in rows if line.split()[1] == arch]
        assert len(lines) == 40, proc.stdout
        assert all(" code object  ok " in line and flags in line for line in lines), proc.stdout
    # the warp kernels trade keys through ds_bpermute and keep them in VGPRs: no scratch
    warp = [line for line in proc.stdout.splitlines()
            if "_warp[" in line.split(" ", 1)[0] and len(line.split()) > 2]
    assert len(warp) == 24 * len(ARCH_FLAGS), proc.stdout  # two shapes x 12 kernels
    assert all(" code object  ok " in line and " 0 B scratch" in line for line in warp), \
        proc.stdout
    # the rank kernels: two shapes x 12 kernels, their keys in VGPRs as well
    rank = [line for line in proc.stdout.splitlines()
            if "_rank[" in line.split(" ", 1)[0] and len(line.split()) > 2]
    assert len(rank) == 24 * len(ARCH_FLAGS), proc.stdout
    assert all(" code object  ok " in line and " 0 B scratch" in line for line in rank), \
        proc.stdout
    # the IPC all-gather's kernels: bump, push and wait_copy in 8-byte words and bytes, wait
    ipc = [line for line in proc.stdout.splitlines()
           if line.startswith("ipc_") and len(line.split()) > 2]
    assert len(ipc) == 6 * len(ARCH_FLAGS), proc.stdout
    assert all(" code object  ok " in line for line in ipc), proc.stdout
    total = (40 + 24 + 24 + 6) * len(ARCH_FLAGS)
    assert f"{total} of {total} kernel x arch compiles reached code object" in proc.stdout, \
        proc.stdout


def _elf(e_type=3, machine=224, flags=0x54C, osabi=64, abi_version=4):
    ident = b"\x7fELF" + bytes([2, 1, 1, osabi, abi_version]) + bytes(7)
    return ident + struct.pack("<HHIQQQIHHHHHH", e_type, machine, 1, 0, 0, 0, flags,
                               64, 0, 0, 0, 0, 0)


def test_code_object_check_accepts_an_amdgpu_dso_for_its_arch():
    from numba_cp.compile_check import check_code_object

    assert check_code_object(_elf(flags=0x54C), "gfx942").startswith(
        "e_flags 0x54c (gfx942, xnack any, sramecc any), code object v6")
    assert "gfx90a" in check_code_object(_elf(flags=0x53F, abi_version=3), "gfx90a")


@pytest.mark.parametrize("kwargs, arch, message", [
    (dict(machine=62), "gfx942", "expected EM_AMDGPU (224)"),
    (dict(e_type=1), "gfx942", "expected ET_DYN"),
    (dict(osabi=0), "gfx942", "expected ELFOSABI_AMDGPU_HSA"),
    (dict(flags=0x53F), "gfx942", "expected 0x4c for gfx942"),
])
def test_code_object_check_rejects_the_wrong_file(kwargs, arch, message):
    from numba_cp.compile_check import check_code_object

    with pytest.raises(ValueError, match=re.escape(message)):
        check_code_object(_elf(**kwargs), arch)
