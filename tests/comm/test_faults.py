"""No rank left hanging: one rank fails at each stage, and every rank raises within seconds.

Each case runs ``mpi_scripts/fault_scenarios.py`` under mpiexec with
short timeouts and asserts every rank's outcome line and the job's wall time.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "mpi_scripts" / "fault_scenarios.py"
TIMEOUT_S = 10  # NUMBA_CP_TIMEOUT for the ranks: a stuck collective gives up after this
IPC_TIMEOUT_S = 5


def run(mpiexec, n, scenario, tmp_path):
    env = dict(os.environ, NUMBA_CP_BACKEND="sim", NUMBA_CP_TIMEOUT=str(TIMEOUT_S),
               NUMBA_CP_IPC_TIMEOUT=str(IPC_TIMEOUT_S), FAULT_DIR=str(tmp_path))
    env.pop("NUMBA_CP_TRANSPORT", None)
    start = time.monotonic()
    proc = subprocess.run([*mpiexec, "-n", str(n), sys.executable, str(SCRIPT), scenario],
                          env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    lines = dict(re.findall(r"^rank (\d+): (.*)$", proc.stdout, flags=re.M))
    assert sorted(map(int, lines)) == list(range(n)), proc.stdout + proc.stderr
    # every rank ended within a few timeouts, not at the test's limit
    assert elapsed < 60 + 3 * TIMEOUT_S, (elapsed, proc.stdout)
    return {int(r): text for r, text in lines.items()}, elapsed


pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


@pytest.mark.parametrize("n", [2, 3])
def test_config_mismatch_raises_on_every_rank(mpiexec, n, tmp_path):
    out, _ = run(mpiexec, n, "config_mismatch", tmp_path)
    assert all(t.startswith("RankAgreementError") and "topk" in t for t in out.values()), out


def test_a_local_config_failure_raises_on_every_rank(mpiexec, tmp_path):
    out, _ = run(mpiexec, 3, "config_local_failure", tmp_path)
    assert all(t.startswith("RankAgreementError") and "rank 1" in t and "nonesuch" in t
               for t in out.values()), out


def test_forced_transport_mismatch_raises_on_every_rank(mpiexec, tmp_path):
    out, _ = run(mpiexec, 2, "transport_mismatch", tmp_path)
    assert all(t.startswith("RankAgreementError") and "transport" in t
               for t in out.values()), out


def test_bad_first_call_on_one_rank_raises_on_every_rank(mpiexec, tmp_path):
    out, _ = run(mpiexec, 3, "first_call_bad_dtype", tmp_path)
    assert all(t.startswith("RankAgreementError") and "rank 1" in t and "scores" in t
               for t in out.values()), out


def test_later_call_with_other_tokens_ends_every_rank(mpiexec, tmp_path):
    out, elapsed = run(mpiexec, 3, "later_call_tokens", tmp_path)
    assert all(t.startswith(("RankAgreementError", "CollectiveTimeoutError"))
               for t in out.values()), out
    assert "CollectiveTimeoutError" in out[1], out  # it asked; nobody answered


def test_an_extra_call_on_one_rank_ends_every_rank(mpiexec, tmp_path):
    out, _ = run(mpiexec, 2, "extra_call", tmp_path)
    assert out[0].startswith("CollectiveTimeoutError") and "all-gather" in out[0], out
    assert out[1].startswith("CollectiveTimeoutError") and "close" in out[1], out


def test_ipc_peer_gone_makes_the_next_call_refuse(mpiexec, tmp_path):
    out, _ = run(mpiexec, 2, "ipc_peer_gone", tmp_path)
    assert out[0].startswith("IPCTimeoutError") and "gave up waiting for rank 1" in out[0], out
    assert out[0].endswith("s)") and "refuses calls" in out[0], out
    assert out[1].startswith("CollectiveTimeoutError") and "close" in out[1], out


def test_a_bad_config_field_on_one_rank_aborts_a_job_run_with_mpi4py(mpiexec, tmp_path):
    """ExchangeConfig raises on one rank before any collective; run as the README says
    (``python -m mpi4py``), the job aborts instead of leaving the peers waiting."""
    env = dict(os.environ, NUMBA_CP_BACKEND="sim")
    start = time.monotonic()
    proc = subprocess.run([*mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(SCRIPT),
                           "config_type_uncaught"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0
    assert time.monotonic() - start < 120, "the job was not aborted"
    assert "ExchangeConfig.heads must be an integer, got bool" in proc.stderr + proc.stdout


def test_two_level_nodes_must_agree_on_every_rank(mpiexec, tmp_path):
    # each job its own rendezvous folder: a rank leaves once every rank's file is there
    runs = {name: tmp_path / name for name in ("mismatch", "bad", "agreed")}
    for folder in runs.values():
        folder.mkdir()
    out, _ = run(mpiexec, 3, "nodes_mismatch", runs["mismatch"])
    assert all(t.startswith("RankAgreementError") and "nodes" in t for t in out.values()), out
    out, _ = run(mpiexec, 2, "nodes_bad_value", runs["bad"])
    assert all(t.startswith("RankAgreementError") and "NUMBA_CP_NODES='0'" in t
               and "rank 0" in t for t in out.values()), out
    out, _ = run(mpiexec, 3, "two_levels_exact", runs["agreed"])  # the same, agreed
    assert all(t.startswith("ok") for t in out.values()), out
