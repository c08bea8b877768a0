"""The main job's command line and report: bad options fail fast, output explains itself.

Option checks run in-process (numba_cp.job_options); the CLI's exit status, its one
line and the absence of a traceback are checked on real processes, under mpiexec
too. The job's JSON is checked in tests/test_exchange.py, which runs it.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from numba_cp import job_options, job_report
from numba_cp.job_options import OptionError, parse_options, token_count
from support import run_mpiexec

ROOT = Path(__file__).resolve().parents[1]


def job_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CP_")}
    env.update(NUMBA_CP_BACKEND="sim", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(autouse=True)
def _no_package_variables(monkeypatch):
    for name in list(os.environ):
        if name.startswith("NUMBA_CP_") and name != "NUMBA_CP_BACKEND":
            monkeypatch.delenv(name)


# -- the options, checked before MPI ---------------------------------------------------

@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("32K", 32768), ("32k", 32768),
                                          (" 1M ", 1 << 20), ("128", 128)])
def test_token_counts_take_suffixes(text, tokens):
    assert token_count(text) == tokens


@pytest.mark.parametrize("argv, message", [
    (["--context", "1000"], "argument --context: '1000' is not a positive multiple of 128"),
    (["--context", "32X"], "argument --context: not a token count: '32X'"),
    (["--context", "0"], "argument --context: '0' is not a positive multiple of 128"),
    (["--context", "64M"], "argument --context: '64M' is past the largest context"),
    (["--transport", "foo"], "argument --transport: invalid choice: 'foo'"),
    (["--heads", "0"], "argument --heads: must be >= 1, got 0"),
    (["--heads", "two"], "argument --heads: not an integer: 'two'"),
    (["--batch", "-3"], "argument --batch: must be >= 1, got -3"),
    (["--topk", "5000"], "argument --topk: must be from 1 to 2048, got 5000"),
    (["--iters", "0"], "argument --iters: must be >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["--threads", "4096"], "argument --threads: must be from 1 to 1024, got 4096"),
    (["--merge", "some"], "argument --merge: invalid choice: 'some'"),
    (["--method", "bitonic"], "argument --method: invalid choice: 'bitonic'"),
    (["--sweep-context", "8K,1000"], "argument --sweep-context: '1000' is not a positive"),
    (["--sweep-context", ","], "argument --sweep-context: expected comma-separated contexts"),
    (["--method", "warp", "--topk", "1024"], "argument --method: method='warp' handles topk"),
    (["--scores", "s.npy"], "argument --scores: --scores and --seq-lens go together"),
    (["--json", "/no/such/folder/out.json"], "argument --json: folder '/no/such/folder'"),
    (["--plot", "/no/such/folder/out.png"], "argument --plot: folder '/no/such/folder'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_name_the_option(argv, message):
    with pytest.raises(OptionError) as raised:
        parse_options(argv)
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("env, message", [
    ({"NUMBA_CP_TRANSPORT": "bogus"}, "NUMBA_CP_TRANSPORT='bogus': unknown transport"),
    ({"NUMBA_CP_TIMEOUT": "-1"}, "NUMBA_CP_TIMEOUT='-1': expected a positive number"),
    ({"NUMBA_CP_IPC_TIMEOUT": "soon"}, "NUMBA_CP_IPC_TIMEOUT='soon': expected a positive"),
    ({"NUMBA_CP_GPU_AWARE_MPI": "maybe"}, "NUMBA_CP_GPU_AWARE_MPI='maybe': expected 0 or 1"),
    ({"NUMBA_CP_IPC_WAIT": "spin"}, "NUMBA_CP_IPC_WAIT='spin': expected 'merge'"),
])
def test_bad_environment_fails_before_mpi(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(OptionError, match=re.escape(message)):
        parse_options([])


def test_good_options_parse():
    args = parse_options(["--context", "32K", "--sweep-context", "8k,16K", "--transport",
                          "staged", "--topk", "2048", "--threads", "1024"])
    assert args.context == 32768 and args.contexts == [8192, 16384]
    assert args.transport == "staged" and args.topk == 2048


def test_scores_from_files_fix_the_shape(tmp_path):
    scores = np.zeros((3, 4, 20), np.float32)
    np.save(tmp_path / "s.npy", scores)
    np.save(tmp_path / "l.npy", np.array([2560, 700], np.int64))
    args = parse_options(["--scores", str(tmp_path / "s.npy"), "--seq-lens",
                          str(tmp_path / "l.npy"), "--query-len", "2"])
    assert args.contexts == [20 * 128] and args.loaded[1].dtype == np.int32
    with pytest.raises(OptionError, match=r"--seq-lens: 2 requests x --query-len 1 != 4 "):
        parse_options(["--scores", str(tmp_path / "s.npy"), "--seq-lens",
                       str(tmp_path / "l.npy")])
    with pytest.raises(OptionError, match="--sweep-context: not with --scores"):
        parse_options(["--scores", str(tmp_path / "s.npy"), "--seq-lens",
                       str(tmp_path / "l.npy"), "--query-len", "2", "--sweep-context", "4K"])
    with pytest.raises(OptionError, match="argument --scores: cannot read"):
        parse_options(["--scores", str(tmp_path / "none.npy"), "--seq-lens",
                       str(tmp_path / "l.npy")])


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(OptionError, match="argument --plot: needs matplotlib"):
        parse_options(["--plot", str(tmp_path / "sweep.png")])


def test_plot_with_matplotlib_draws_the_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    parse_options(["--plot", str(tmp_path / "sweep.png")])
    stages = {s: job_report.stage_statistics(np.full((2, 3), 1e-3)) for s in job_report.STAGES}
    runs = [dict(context=c, stages=stages) for c in (2048, 4096)]
    job_report.plot_sweep(runs, tmp_path / "sweep.png", world=2, backend="sim")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_world_checks_fail_the_same_on_every_rank():
    args = parse_options(["--fail-rank", "3"])
    with pytest.raises(OptionError, match="--fail-rank: 3 is not a rank of this world of 2"):
        job_options.check_with_world(args, 2, lambda context: None)
    args = parse_options([])

    def refuse(context):
        raise ValueError("ExchangeConfig.heads must be >= 1, got 0")

    with pytest.raises(OptionError, match="context 16384, world 2: ExchangeConfig.heads"):
        job_options.check_with_world(args, 2, refuse)


def test_pretend_nodes_are_checked_with_the_world(monkeypatch):
    args = parse_options(["--hierarchy", "node"])
    monkeypatch.setenv("NUMBA_CP_NODES", "3,2")
    with pytest.raises(OptionError, match="NUMBA_CP_NODES='3,2': node sizes .* add up to "
                                          "the 4 ranks"):
        job_options.check_with_world(args, 4, lambda context: None)
    job_options.check_with_world(args, 5, lambda context: None)  # 3 + 2 ranks: fine
    flat = parse_options([])  # the flat exchange reads no nodes
    job_options.check_with_world(flat, 4, lambda context: None)
    assert args.hierarchy == "node" and flat.hierarchy == "flat"


def test_transport_choices_are_the_packages():
    from numba_cp.comm import TRANSPORTS

    assert sorted(job_options.TRANSPORT_CHOICES) == sorted(TRANSPORTS)


def test_help_ends_with_every_variable_the_package_reads():
    text = job_options.build_parser().format_help()
    tail = text[text.index("environment variables the package reads:"):]
    assert text.rstrip().endswith(tail.rstrip())
    read = set()
    for path in (ROOT / "numba_cp").rglob("*.py"):
        read |= set(re.findall(r"\b(NUMBA_CP_[A-Z_]+)\b", path.read_text()))
    documented = {name for name, _ in job_options.ENVIRONMENT}
    assert read <= documented, f"--help misses {sorted(read - documented)}"
    assert all(name in tail for name in documented)


# -- the command, as processes ---------------------------------------------------------

def run_cli(*args, env=None, prelude=""):
    code = prelude + "from numba_cp.main_job import cli; cli()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env or job_env(),
                          capture_output=True, text=True, timeout=120)


def test_help_works_and_lists_the_variables():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: numba-cp-exchange")
    tail = proc.stdout[proc.stdout.index("environment variables the package reads:"):]
    assert all(name in tail for name, _ in job_options.ENVIRONMENT), proc.stdout
    assert "\n  --" not in tail, "the variables come last"


@pytest.mark.parametrize("args", [["--context", "1000"], ["--transport", "foo"],
                                  ["--heads", "0"]])
def test_a_bad_option_exits_2_with_one_line(args):
    start = time.monotonic()
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"numba-cp-exchange: error: argument {args[0]}: ")
    assert time.monotonic() - start < 30


def test_plot_without_matplotlib_exits_2_before_running(tmp_path):
    proc = run_cli("--plot", str(tmp_path / "p.png"),
                   prelude="import sys; sys.modules['matplotlib'] = None\n")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "argument --plot: needs matplotlib" in proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [["--context", "1000"], ["--transport", "foo"],
                                  ["--heads", "0"], ["--fail-rank", "7"]],
                         ids=["context", "transport", "heads", "fail-rank-past-world"])
def test_under_mpiexec_every_rank_exits_2_and_one_line_shows(mpiexec, args):
    start = time.monotonic()
    command = [*mpiexec, "-n", "3", sys.executable, "-m", "numba_cp.main_job", *args]
    status, output = run_mpiexec(command, env=job_env(), cwd=ROOT)
    assert status == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("numba-cp-exchange: error: argument "
                                                   f"{args[0]}: "), output
    assert "Traceback" not in output and "Abort" not in output, output
    assert time.monotonic() - start < 60


# -- the report ------------------------------------------------------------------------

@pytest.mark.parametrize("text, name", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri\x00", "MPICH 5.0.2"),
    ("Open MPI v5.0.3, package: Open MPI builder Distribution, ident: 5.0.3, repo rev: "
     "v5.0.3, Mar 26, 2024\x00", "Open MPI 5.0.3"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO : x",
     "Cray MPICH 8.1.28.2"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", "Intel MPI 2021.10"),
    ("MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date\t:\tWed", "MVAPICH 2.3.7"),
    ("Some   MPI  9\nmore", "Some MPI 9"),
])
def test_mpi_library_names_read_cleanly(text, name):
    assert job_report.mpi_library_name(text) == name


def test_statistics_take_the_slowest_rank_per_iteration():
    seconds = np.array([[1, 5, 2, 4], [3, 1, 2, 8]]) * 1e-6  # [ranks, iterations]
    stats = job_report.stage_statistics(seconds)  # slowest per iteration: 3, 5, 2, 8
    assert stats == {"min_us": 2.0, "median_us": 4.0, "p90_us": pytest.approx(7.1),
                     "max_us": 8.0}


def test_payload_counts_bytes_and_bandwidth_as_nccl_tests():
    payload = job_report.gather_payload(world=4, heads=2, tokens=8, keys=16, median_us=2.0)
    assert payload["bytes_sent_per_rank"] == 2 * 8 * 16 * 8
    assert payload["bytes_received_per_rank"] == 4 * 2048
    assert payload["algbw_GBps"] == pytest.approx(8192 / 2e-6 / 1e9)
    assert payload["busbw_GBps"] == pytest.approx(payload["algbw_GBps"] * 3 / 4)


def test_the_table_says_what_its_numbers_mean():
    stages = {s: job_report.stage_statistics(np.ones((2, 3)) * 1e-3)
              for s in job_report.STAGES + job_report.REPLAY_STAGES}
    config = dict(world=2, heads=2, topk=16, per_shard=None)
    payload = job_report.gather_payload(world=2, heads=2, tokens=8, keys=16, median_us=1000.0)
    run = dict(stages=stages, config=config, tokens=8, all_gather=payload)
    text = "\n".join(job_report.format_timings(run, iters=3, warmup=0, replays=20,
                                               simulator=True))
    for needle in ("3 timed iterations", "slowest rank", "need not add up to total",
                   "first timed iteration includes", "replay, 1 per iteration",
                   "replay, 20 back to back", "each rank sends 2.0 KiB and receives 4.0 KiB",
                   "algbw", "busbw", "simulator"):
        assert needle in " ".join(text.split()), needle
    header = [line for line in text.splitlines() if line.startswith("stage")][0]
    assert header.split() == ["stage", "min", "median", "p90", "max"]
    quiet = job_report.format_timings(run, iters=3, warmup=0, replays=20, simulator=True,
                                      explain=False)
    assert len(quiet) < len(text.splitlines()) and not any("simulator" in q for q in quiet)
