"""benchmarks/gpu_kernels.sh without a GPU: its steps run, in order, with stand-ins for the
interpreter and Nsight Compute; and the benchmark commands it writes parse."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_kernels.sh")

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None,
                                reason="benchmarks/gpu_kernels.sh needs coreutils' timeout")


def stand_ins(tmp_path, fail_on=None):
    """A bin folder with a `python` that records its arguments (and fails when they hold
    ``fail_on``) and an `ncu` that records its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fail = f'case "$*" in *{fail_on}*) exit 3 ;; esac\n' if fail_on else ""
    for name in ("python", "ncu"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\n{fail}echo ran {name}\n')
        path.chmod(0o755)
    return bin_dir, calls


def run_script(tmp_path, bin_dir, out, **env):
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHON=str(bin_dir / "python"), **env)
    env.pop("NUMBA_CP_BACKEND", None)  # the script's own default, cuda
    return subprocess.run(["bash", SCRIPT, str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_step_runs_in_order_and_a_failed_one_fails_the_run(tmp_path):
    bin_dir, calls = stand_ins(tmp_path, fail_on="--sweep-launch")
    out = tmp_path / "out"
    proc = run_script(tmp_path, bin_dir, out)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [line.split()[:2] for line in lines] == [
        ["PASS", "facts"], ["PASS", "kernels"], ["FAIL", "sweep"], ["PASS", "host"],
        ["PASS", "ncu"], ["PASS", "tests"]], proc.stdout
    assert "exit 3" in lines[2]
    recorded = calls.read_text().splitlines()
    assert [line.split()[1] for line in recorded] == [
        "-c", "benchmarks/bench_kernels.py", "benchmarks/bench_kernels.py",
        "benchmarks/profile_call.py", "--clock-control", "-m"]
    assert recorded[4].endswith("benchmarks/profile_kernels.py launch --cases a,b,g "
                                "--method auto")
    kernels = (out / "kernels.txt").read_text().splitlines()
    assert kernels[0].startswith("$ NUMBA_CP_BACKEND=cuda ")  # each log opens with its command
    assert kernels[-1] == "ran python"
    facts = (out / "facts.txt").read_text().splitlines()
    assert facts[0].startswith("commit ") and facts[-1] == "ran python", facts


def test_steps_pick_a_part_and_an_unknown_step_runs_nothing(tmp_path):
    bin_dir, calls = stand_ins(tmp_path)
    proc = run_script(tmp_path, bin_dir, tmp_path / "part", STEPS="kernels tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [
        ["PASS", "kernels"], ["PASS", "tests"]]
    before = calls.read_text()
    proc = run_script(tmp_path, bin_dir, tmp_path / "none", STEPS="kernels nvprof")
    assert proc.returncode == 2 and "unknown step 'nvprof'" in proc.stderr
    assert calls.read_text() == before and not (tmp_path / "none").exists()


def test_the_benchmark_commands_parse(tmp_path):
    # Each benchmark parses its arguments before it refuses the simulator, so a flag the
    # script gets wrong shows as an argparse error instead of the refusal.
    bin_dir, calls = stand_ins(tmp_path)
    out = tmp_path / "out"
    proc = run_script(tmp_path, bin_dir, out, STEPS="kernels sweep host")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = [shlex.split(line)[1:] for line in calls.read_text().splitlines()]
    assert len(commands) == 3
    for args in commands:
        run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, NUMBA_CP_BACKEND="sim"), timeout=120)
        assert run.returncode == 1 and "times a GPU" in run.stderr, (args, run.stderr)
        assert str(out) in " ".join(args)  # the JSON goes under the run's folder
