"""benchmarks/bench_exchange.py runs its MPI jobs end to end on the simulator and checks them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bench_exchange_small_run(tmp_path, mpiexec):
    out = tmp_path / "bench.json"
    env = dict(os.environ, NUMBA_CP_BACKEND="sim", NUMBA_CP_MPIEXEC=" ".join(mpiexec))
    proc = subprocess.run([sys.executable, "benchmarks/bench_exchange.py", "--worlds", "1,2",
                           "--cases", "g", "--small", "--replays", "1", "--iterations", "1",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["world"], r["gather"], r["fused"]) for r in rows] == [
        (1, "none", False), (2, "ipc-fused", True), (2, "ipc", False), (2, "staged", False),
        (2, "alone", False)]
    assert all(r["exact"] and len(r["per_rank"]) == r["world"] for r in rows), rows
    assert all(r["eager_host_us"] > 0 for r in rows), rows


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bench_exchange_two_level_gathers(tmp_path, mpiexec):
    """Both two-level forms on two pretend nodes of one rank: exact, and the fused one
    reports its node level fused."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, NUMBA_CP_BACKEND="sim", NUMBA_CP_MPIEXEC=" ".join(mpiexec),
               NUMBA_CP_NODES="2")
    proc = subprocess.run([sys.executable, "benchmarks/bench_exchange.py", "--worlds", "2",
                           "--cases", "g", "--small", "--replays", "1", "--iterations", "1",
                           "--gathers", "two-level,two-level-fused", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["world"], r["gather"], r["fused"]) for r in rows] == [
        (2, "two-level", False), (2, "two-level-fused", True)]
    assert all(r["exact"] for r in rows), rows
