"""The exchange plan and the main job under mpiexec, against the unsharded oracle.

Single-process tests drive CandidateExchange on COMM_SELF; multi-rank tests run
launch/exchange.py (the job users run) under ``mpiexec -n N`` on the simulator
and read its JSON, which names the world size it saw: a launcher/MPI-library
mismatch that silently runs N singletons fails here.
"""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from numba_cp import reference as ref  # noqa: E402
from numba_cp.errors import RankAgreementError  # noqa: E402
from numba_cp.exchange import CandidateExchange, ExchangeConfig, owned_heads  # noqa: E402
from support import run_mpiexec, to_device, to_host  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "launch" / "exchange.py"
SMALL = ["--heads", "2", "--batch", "3", "--context", "4K", "--topk", "8", "--iters", "1",
         "--warmup", "0"]

pytestmark = pytest.mark.timeout(200)


def job(mpiexec, n, *args, env=None, tmp_path=None, mpmd=None):
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_CP_TRANSPORT"}
    environment.update(NUMBA_CP_BACKEND="sim", PYTHONUNBUFFERED="1", **(env or {}))
    command = [*mpiexec, "-n", str(n), sys.executable, str(JOB), *args]
    for extra_n, extra_args in mpmd or []:
        command += [":", "-n", str(extra_n), sys.executable, str(JOB), *extra_args]
    return run_mpiexec(command, env=environment, cwd=ROOT)


@pytest.mark.mpi
@pytest.mark.parametrize("n, extra", [
    (1, []),
    (2, ["--sparse-table", "--heads", "1", "--topk", "6"]),
    (3, ["--merge", "owned", "--query-len", "2"]),  # heads 2 < world 3: replicated heads
    (4, ["--merge", "owned", "--heads", "5", "--sparse-table"]),
])
def test_main_job_is_exact_for_each_world(mpiexec, tmp_path, n, extra):
    out = tmp_path / "result.json"
    status, output = job(mpiexec, n, *SMALL, *extra, "--json", str(out))
    assert status == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == n, "ranks ran as singletons: mpiexec and mpi4py's MPI differ"
    assert result["exact"] is True
    assert result["transport"].startswith("none" if n == 1 else "host")
    assert set(result["stages"]) == {"pack", "all_gather", "merge", "total"}
    assert all(set(s) == {"min_us", "median_us", "p90_us", "max_us"}
               for s in result["stages"].values())
    assert output.rstrip().splitlines()[-1].startswith("EXACT")
    check_self_describing_json(result, n, iters=1)


def check_self_describing_json(result, world, *, iters):
    """What a reader of the JSON needs: versions, where ranks ran, how, raw figures."""
    import numba_cp

    assert result["format"] == "numba_cp-exchange/2"
    assert result["numba_cp"] == result["versions"]["numba_cp"] == numba_cp.__version__
    assert {"python", "numba", "numpy", "mpi4py"} <= set(result["versions"])
    assert result["backend"] == "sim" and result["simulator"] is True
    assert result["mpi"]["library"] and "\x00" not in result["mpi"]["library_version"]
    assert [r["rank"] for r in result["ranks"]] == list(range(world))
    assert result["hosts"] and all(r["host"] in result["hosts"] for r in result["ranks"])
    assert result["command"][1:3] == [str(JOB), "--heads"] and "--json" in result["command"]
    assert result["iters"] == iters and "slowest rank" in result["aggregation"]
    for run in result["runs"]:
        for stage, per_rank in run["per_rank_us"].items():
            assert stage in run["stages"]
            assert np.asarray(per_rank).shape == (world, iters), stage
            slowest = np.asarray(per_rank).max(axis=0)
            assert run["stages"][stage]["max_us"] == pytest.approx(slowest.max(), abs=1e-3)
        payload = run["all_gather"]
        c = run["config"]
        assert payload["bytes_sent_per_rank"] == c["heads"] * run["tokens"] * c["topk"] * 8
        assert payload["bytes_received_per_rank"] == world * payload["bytes_sent_per_rank"]
        assert (payload["algbw_GBps"] is None) == (world == 1)


@pytest.mark.mpi
def test_staged_transport_path_is_exact(mpiexec, tmp_path):
    out = tmp_path / "staged.json"
    status, output = job(mpiexec, 3, *SMALL, "--sparse-table", "--heads", "1", "--json",
                         str(out), env={"NUMBA_CP_TRANSPORT": "staged"})
    assert status == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert result["exact"] is True and result["transport"].startswith("staged")


@pytest.mark.mpi
def test_mismatched_configuration_fails_on_every_rank(mpiexec):
    status, output = job(mpiexec, 1, *SMALL, mpmd=[(2, [*SMALL[:-4], "--topk", "9",
                                                        "--iters", "1", "--warmup", "0"])])
    assert status != 0
    for rank in range(3):
        assert (f"rank {rank}: RankAgreementError: CandidateExchange: ranks disagree on topk: "
                "8 on rank(s) 0; 9 on rank(s) 1, 2") in output, output[-4000:]


@pytest.mark.mpi
def test_a_failing_rank_ends_the_job(mpiexec):
    """The other ranks would wait forever in the next collective: the job must abort.

    (The failing rank's traceback usually shows, but MPI_Abort may kill the
    processes before the launcher forwards their last output, so it is not
    asserted. An option error exits with the same status before any rank starts,
    so the test refuses one.)
    """
    start = time.monotonic()
    status, output = job(mpiexec, 3, *SMALL, "--fail-rank", "2")
    assert status != 0, output[-4000:]
    assert "numba-cp-exchange: error:" not in output, output[-4000:]
    assert time.monotonic() - start < 60, "the job did not end promptly"


@pytest.mark.mpi
def test_sweep_writes_every_context_and_its_plot(mpiexec, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    status, output = job(mpiexec, 2, *SMALL, "--sweep-context", "2K,4K", "--json", str(out),
                         *plot)
    assert status == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert [r["context"] for r in result["runs"]] == [2048, 4096]
    assert "[2/2] context 4096" in output
    check_self_describing_json(result, 2, iters=1)
    if plot:  # without matplotlib, --plot fails before the run (tests/test_main_job.py)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the plan itself, in one process ---------------------------------------------------

def small_config(**change):
    config = dict(heads=3, max_tokens=4, topk=5, world=1, global_blocks=20, init_blocks=1,
                  local_blocks=1, query_len=2)
    config.update(change)
    return ExchangeConfig(**config)


def test_plan_on_one_rank_with_fewer_tokens_than_planned():
    comm = MPI.COMM_SELF
    config = small_config(sparse_table=True)
    rng = np.random.default_rng(4)
    full = rng.standard_normal((3, 2, 20)).astype(np.float32)  # 2 tokens of the 4 planned
    seq = np.array([20 * 128], np.int32)
    table = rng.integers(0, 99, size=(1, 20), dtype=np.int32)
    with CandidateExchange(comm, config, method="radix", threads=4) as plan:
        for _ in range(2):  # the second call reuses every buffer
            idx, sbt, ctx = plan(to_device(full), to_device(seq),
                                 attention_block_table=to_device(table))
    want = ref.global_topk(full, seq, topk=5, query_len=2, global_blocks=20, init_blocks=1,
                           local_blocks=1)
    np.testing.assert_array_equal(to_host(idx), want)
    want_sbt, want_ctx = ref.sparse_block_table(want, seq, table, query_len=2)
    np.testing.assert_array_equal(to_host(sbt), want_sbt)
    np.testing.assert_array_equal(to_host(ctx), want_ctx)


def test_one_plan_serves_several_token_counts_with_one_transport():
    """Buffers and transport are sized once, for max_tokens; each call uses its own rows."""
    rng = np.random.default_rng(21)
    config = small_config(max_tokens=6)
    with CandidateExchange(MPI.COMM_SELF, config, method="warp") as plan:
        transport = plan.transport
        for tokens in (4, 0, 6, 2):
            full = rng.standard_normal((3, tokens, 20)).astype(np.float32)
            seq = rng.integers(1, 22 * 128, tokens // 2).astype(np.int32)
            idx = plan(to_device(full), to_device(seq))
            assert plan.transport is transport
            want = ref.global_topk(full, seq, topk=5, query_len=2, global_blocks=20,
                                   init_blocks=1, local_blocks=1)
            assert to_host(idx).shape == (3, tokens, 5)
            np.testing.assert_array_equal(to_host(idx), want)
        with pytest.raises(ValueError, match=r"tokens .* in \[0, 6\], got 8"):
            plan(to_device(np.zeros((3, 8, 20), np.float32)), to_device(np.ones(4, np.int32)))


@pytest.mark.parametrize("change, error, message", [
    (dict(topk=0), ValueError, r"ExchangeConfig.topk must be in \[1, 2049\), got 0"),
    (dict(max_tokens=3), ValueError, "multiple of query_len"),
    (dict(global_blocks=70000), ValueError, "ExchangeConfig.global_blocks"),
    (dict(merge="some"), ValueError, "ExchangeConfig.merge must be"),
    (dict(heads=True), TypeError, "ExchangeConfig.heads must be an integer, got bool"),
    (dict(global_blocks=8.5), TypeError, "ExchangeConfig.global_blocks must be an integer"),
    (dict(heads="1"), TypeError, "ExchangeConfig.heads must be an integer, got str"),
    (dict(query_len=0), ValueError, "ExchangeConfig.query_len must be >= 1"),
    (dict(sparse_table="no"), TypeError, "ExchangeConfig.sparse_table must be a bool"),
    (dict(block_page_stride=-3), ValueError, "ExchangeConfig.block_page_stride"),
    (dict(block_page_stride=2**40), ValueError, "ExchangeConfig.block_page_stride"),
    (dict(local_blocks=2**31), ValueError, "ExchangeConfig.local_blocks"),
])
def test_configuration_is_checked_when_made(change, error, message):
    with pytest.raises(error, match=message):
        small_config(**change)


def test_plan_rejects_a_world_other_than_the_communicators():
    with pytest.raises(RankAgreementError, match="world is 2 but the communicator has 1 rank"):
        CandidateExchange(MPI.COMM_SELF, small_config(world=2))


def test_fused_is_asked_for_with_a_bool_and_refused_where_it_cannot_run():
    with pytest.raises(RankAgreementError, match="fused must be None, True or False, got 1"):
        CandidateExchange(MPI.COMM_SELF, small_config(), fused=1)
    with pytest.raises(ValueError, match="fused=True, but world 1 needs no gather"):
        CandidateExchange(MPI.COMM_SELF, small_config(), fused=True)
    with CandidateExchange(MPI.COMM_SELF, small_config(), fused=None) as plan:
        assert plan.fused is False and "fused" not in plan.describe()


def test_plan_rejects_misused_table_and_token_counts():
    with CandidateExchange(MPI.COMM_SELF, small_config()) as plan:
        scores = to_device(np.zeros((3, 6, 20), np.float32))
        with pytest.raises(ValueError, match="tokens"):
            plan.pack(scores, to_device(np.zeros(3, np.int32)))
        with pytest.raises(ValueError, match="attention_block_table"):
            plan.merge(to_device(np.zeros(2, np.int32)), 4,
                       attention_block_table=to_device(np.zeros((2, 20), np.int32)))


@pytest.mark.parametrize("heads, world", [(8, 4), (5, 4), (2, 4), (3, 8), (1, 3)])
def test_owned_heads_cover_every_head(heads, world):
    slices = [owned_heads(heads, world, r) for r in range(world)]
    covered = sorted({h for s in slices for h in s})
    assert covered == list(range(heads))
    assert all(len(s) >= 1 for s in slices)
    if heads >= world:  # an even, disjoint split
        assert sum(len(s) for s in slices) == heads
        assert max(len(s) for s in slices) - min(len(s) for s in slices) <= 1


def test_captured_exchange_replays_new_inputs_in_place():
    """capture() then replay(): results follow the inputs' current contents (world 1)."""
    rng = np.random.default_rng(12)
    config = small_config(sparse_table=True)
    seq = np.array([20 * 128, 700], np.int32)
    table = rng.integers(0, 99, size=(2, 20), dtype=np.int32)
    scores = to_device(rng.standard_normal((3, 4, 20)).astype(np.float32))
    seq_d, table_d = to_device(seq), to_device(table)
    with CandidateExchange(MPI.COMM_SELF, config, method="radix", threads=4) as plan:
        assert plan.gather_is_capturable and plan.describe().startswith("none")
        captured = plan.capture(scores, seq_d, attention_block_table=table_d)
        for _ in range(2):
            fresh = rng.standard_normal((3, 4, 20)).astype(np.float32)
            scores[...] = to_device(fresh)
            idx, sbt, ctx = captured.replay()
            want = ref.global_topk(fresh, seq, topk=5, query_len=2, global_blocks=20,
                                   init_blocks=1, local_blocks=1)
            np.testing.assert_array_equal(to_host(idx), want)
            want_sbt, want_ctx = ref.sparse_block_table(want, seq, table, query_len=2)
            np.testing.assert_array_equal(to_host(sbt), want_sbt)
            np.testing.assert_array_equal(to_host(ctx), want_ctx)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_graph_replay_through_mpi_gather_is_exact(mpiexec, tmp_path, n):
    out = tmp_path / "graph.json"
    status, output = job(mpiexec, n, *SMALL, "--graph", "--replays", "1", "--sparse-table",
                         "--heads", "1", "--json", str(out))
    assert status == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert result["exact"] is True
    assert {"graph_replay", "graph_replay_back_to_back"} <= set(result["stages"])
    assert result["replays"] == 1
    assert "replay, 1 per iteration" in output and "replay, 1 back to back" in output


def test_closing_the_plan_stops_its_captured_exchanges():
    scores = to_device(np.zeros((3, 4, 20), np.float32))
    seq = to_device(np.full(2, 999, np.int32))
    plan = CandidateExchange(MPI.COMM_SELF, small_config(), method="radix", threads=4)
    captured = plan.capture(scores, seq)
    captured.replay()
    plan.check()
    plan.close()
    with pytest.raises(RuntimeError, match="closed"):
        captured.replay()
