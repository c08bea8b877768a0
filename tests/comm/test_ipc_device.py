"""The device-side gathers on a real GPU, across processes: IPC (and NCCL) end to end.

``mpi_scripts/ipc_device_check.py`` runs under ``mpiexec -n 2`` and ``-n 4``
on the active GPU target (``NUMBA_CP_BACKEND=cuda pytest ...``; the ranks may
share one GPU) and reports one verdict per check; the main job
``launch/exchange.py --transport ipc --graph`` must be EXACT against the
unsharded oracle. Under the simulator those tests are skipped, and the same
script runs once on the CPU instead (IPC on host shared memory, graphs
replayed eagerly), so the checks themselves stay exercised everywhere.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

pytest.importorskip("mpi4py.MPI")

from comm_support import ROOT, SCRIPTS, script_env  # noqa: E402
from numba_cp.backend import TARGET, cuda  # noqa: E402
from support import run_mpiexec  # noqa: E402

# What every run must pass: each check's name, as the script prints it.
IPC_CHECKS = ("choose", "eager int64 keys", "eager float16", "eager uint8 odd bytes",
              "eager int64 tiny", "eager fewer tokens", "eager back-to-back", "graph replay",
              "timeout and poison", "exchange graph")
GPU_TIMEOUT_S = 900  # every rank compiles the kernels it launches on first use


def verdicts(output):
    """``{check: (verdict, detail)}`` from the script's ``PASS|FAIL|SKIP  <check>  <detail>``."""
    found = {}
    for line in output.splitlines():
        # a rank's stderr (Numba's colour codes) may run into rank 0's line
        parts = re.sub(r"\x1b\[[0-9;]*m", "", line).split("  ", 2)
        if parts[0] in ("PASS", "FAIL", "SKIP") and len(parts) >= 2:
            assert parts[1] not in found, f"{parts[1]} reported twice:\n{output[-4000:]}"
            found[parts[1]] = (parts[0], parts[2] if len(parts) > 2 else "")
    return found


def run_check(mpiexec, n, *args, backend, timeout):
    command = [*mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / "ipc_device_check.py"),
               *args]
    return run_mpiexec(command, env=script_env(backend), cwd=ROOT, timeout=timeout)


def _gpus():
    return len(cuda.gpus)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(GPU_TIMEOUT_S + 60)
@pytest.mark.parametrize("n", [2, 4])
def test_ipc_checks_on_the_gpu(mpiexec, n):
    nccl_world = _gpus() >= n  # NCCL refuses two ranks on one GPU
    status, output = run_check(mpiexec, n, *(["--nccl-world"] if nccl_world else []),
                               backend=TARGET.name, timeout=GPU_TIMEOUT_S)
    found = verdicts(output)
    expected = IPC_CHECKS + ("nccl self",) + (("nccl world",) if nccl_world else ())
    assert {name: found.get(name, ("missing",))[0] for name in expected} \
        == dict.fromkeys(expected, "PASS"), output[-6000:]
    assert set(found) == set(expected), output[-6000:]
    assert f"ipc_device_check: {len(expected)} passed, 0 failed, 0 skipped (world {n})" \
        in output, output[-6000:]
    assert status == 0, output[-6000:]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.timeout(GPU_TIMEOUT_S + 60)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("extra", [[], ["--sparse-table", "--merge", "owned"]],
                         ids=["all-heads", "table-owned"])
def test_main_job_ipc_graph_on_the_gpu(mpiexec, tmp_path, n, extra):
    out = tmp_path / "exchange.json"
    command = [*mpiexec, "-n", str(n), sys.executable, str(ROOT / "launch" / "exchange.py"),
               "--transport", "ipc", "--graph", "--iters", "5", "--warmup", "1", *extra,
               "--json", str(out)]
    status, output = run_mpiexec(command, env=script_env(TARGET.name), cwd=ROOT,
                                 timeout=GPU_TIMEOUT_S)
    assert status == 0, output[-6000:]
    result = json.loads(out.read_text())
    assert result["world"] == n and result["exact"] is True, output[-6000:]
    assert result["transport"].startswith("ipc (forced"), result["transport"]
    assert "graph_replay" in result["stages"]


@pytest.mark.mpi
@pytest.mark.skipif(not TARGET.simulator, reason="the GPU runs are the tests above")
def test_ipc_checks_on_the_simulator(mpiexec):
    status, output = run_check(mpiexec, 2, "--replays", "6", "--verify-every", "2", "--calls",
                               "4", backend="sim", timeout=150)
    found = verdicts(output)
    assert {name: found.get(name, ("missing",))[0] for name in IPC_CHECKS} \
        == dict.fromkeys(IPC_CHECKS, "PASS"), output[-4000:]
    assert found["choose"][1].startswith("staged: "), found["choose"]
    assert found["nccl self"][0] == "SKIP" and found["nccl self"][1].startswith("no NCCL")
    assert set(found) == set(IPC_CHECKS) | {"nccl self"}, output[-4000:]
    assert status == 0, output[-4000:]
