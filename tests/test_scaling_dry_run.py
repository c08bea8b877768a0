"""launch/scaling.sh runs end to end on the simulator (DRY=1), and its tables say EXACT."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_scaling_dry_run(tmp_path, mpiexec):
    env = dict(os.environ, DRY="1", WORLDS="1 2 4", TRANSPORTS="host", CASES="a g",
               LEVEL_CASES="a", LEVEL_NODES="2",
               MPIRUN=" ".join(mpiexec), PYTHON=sys.executable, NUMBA_CP_BACKEND="sim")
    if shutil.which("timeout") is None:
        pytest.skip("launch/scaling.sh needs coreutils' timeout")
    proc = subprocess.run(["bash", "launch/scaling.sh", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "FAIL" not in out, out
    # 6 case runs + a two-level run (world 4, 2 pretend nodes) + the context sweep + the
    # world sweep (worlds 1, 2 and 4)
    assert out.count("PASS ") == 11, out
    assert "PASS  case-a-w4-two-level" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| case") and not line.startswith("| context")
            and not line.startswith("| world |")]
    assert len(rows) == 12 and all(line.rstrip().endswith("| True |") for line in rows), out
    assert any(line.startswith("| a | 4 | two-level |") for line in rows), out
