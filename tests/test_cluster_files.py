"""The files cluster users start from: the package metadata, the conda environments, the
Slurm example and the license agree with the code and with each other."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def extras():
    block = PYPROJECT[PYPROJECT.index("[project.optional-dependencies]"):]
    block = block[:block.index("\n[", 1)]
    return set(re.findall(r"^([a-z0-9_]+) = \[", block, flags=re.M))


def test_the_version_is_written_once():
    import numba_cp

    assert 'dynamic = ["version"]' in PYPROJECT
    assert 'version = {attr = "numba_cp.__version__"}' in PYPROJECT
    assert not re.search(r'^version = "', PYPROJECT, flags=re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+", numba_cp.__version__)


def test_the_console_command_is_the_main_job():
    from numba_cp import main_job

    assert 'numba-cp-exchange = "numba_cp.main_job:cli"' in PYPROJECT
    assert callable(main_job.cli)
    assert "numba_cp.main_job" in (ROOT / "launch" / "exchange.py").read_text()


def test_the_simulator_needs_no_extra_and_no_toolkit_wheels():
    deps = PYPROJECT[PYPROJECT.index("dependencies = ["):]
    deps = deps[:deps.index("]\n")]
    assert '"numba-cuda>=0.30.4,<0.31"' in deps and "[cu1" not in deps
    assert {"cuda", "cuda12", "mpich", "plot", "test"} <= extras()


@pytest.mark.parametrize("name", ["environment.yml", "environment-cray.yml",
                                  "environment-cuda.yml", "environment-cuda12.yml"])
def test_conda_environments_name_what_exists(name):
    text = (ROOT / name).read_text()
    for path in re.findall(r"^\s+- -r (\S+)", text, flags=re.M):
        assert (ROOT / path).is_file(), path
    for extra in re.findall(r"^\s+- -e \.\[([a-z0-9_,]+)\]", text, flags=re.M):
        assert set(extra.split(",")) <= extras(), extra
    assert re.search(r"^name: numba_cp-", text, flags=re.M)


def test_the_cray_environment_needs_no_edits():
    text = (ROOT / "environment-cray.yml").read_text()
    assert re.search(r"^\s+- mpich=4\.\*=external_\*", text, flags=re.M)
    assert "- mpich\n" not in text


def test_slurm_example_lets_ranks_of_a_node_map_each_other():
    text = (ROOT / "launch" / "slurm_exchange.sbatch").read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.M)
    assert any(d.startswith("--gpus-per-node=") for d in directives), directives
    assert not any(d.startswith(("--gpus-per-task", "--gpu-bind")) for d in directives)
    assert "numba-cp-exchange" in text


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in PYPROJECT
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("path", [".venv-sim/bin/python", ".venv-cuda12-site-mpi/x",
                                  ".venv-ptx-check/x", ".venv/x"])
def test_environments_are_ignored(path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert proc.returncode == 0, path
