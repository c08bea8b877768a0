"""The transports across real processes: scripts from ``mpi_scripts/`` under ``mpiexec -n N``.

Every job runs on the simulator (``NUMBA_CP_BACKEND=sim``): the device
transports move the simulator's device arrays (host memory), the IPC
transport maps host shared memory, and NCCL is the stand-in of
``fake_nccl.py``. Each rank checks its gathers against every rank's payload,
computed independently, and the plans against the unsharded oracle.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("mpi4py.MPI")

from comm_support import ROOT, oks, problems, run_ranks, script_env  # noqa: E402
from numba_cp.comm import GPU_AWARE_ENV, TRANSPORT_ENV  # noqa: E402
from support import run_mpiexec  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(200)]

DTYPES = ("int64", "float16", "uint16")
ROUNDS = 2
CHOICES = "host, ipc, mpi-device, nccl, staged"


def allgather_check(mpiexec, n, tmp_path, *args, env=None):
    return run_ranks(mpiexec, n, tmp_path / f"ranks-{n}", "allgather_check.py", *args, env=env)


def values_labels(name, asked):
    return sorted(f"transport={name} asked={asked} dtype={dtype} round={r}"
                  for dtype in DTYPES for r in range(ROUNDS))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mpi_transports_gather_exactly(mpiexec, tmp_path, n):
    status, lines, output = allgather_check(mpiexec, n, tmp_path)
    assert status == 0, output[-4000:]
    expected = sorted(label for name in ("host", "staged", "mpi-device")
                      for label in values_labels(name, name))
    for rank, text in lines.items():
        assert not problems(text), text
        assert sorted(oks(text)) == expected, f"rank {rank}:\n" + "\n".join(text)


@pytest.mark.parametrize("n, transports, extra, want", [
    (1, "ipc", [], "ipc"),
    (2, "ipc", [], "ipc"),
    (4, "ipc", [], "ipc"),
    (3, "nccl", ["--fake-nccl"], "nccl"),
    (3, "auto", ["--ipc-probe", "all"], "ipc"),
    (3, "auto", ["--ipc-probe", "0,2"], "staged"),
], ids=["ipc-1", "ipc-2", "ipc-4", "fake-nccl-3", "auto-ipc-3", "auto-rank1-says-no-3"])
def test_device_side_transports_gather_exactly(mpiexec, tmp_path, n, transports, extra, want):
    status, lines, output = allgather_check(mpiexec, n, tmp_path, "--transports", transports,
                                            *extra)
    assert status == 0, output[-4000:]
    for rank, text in lines.items():
        assert not problems(text), text
        assert sorted(oks(text)) == values_labels(want, transports), \
            f"rank {rank}:\n" + "\n".join(text)


@pytest.mark.parametrize("n", [2, 3])
def test_one_setup_serves_every_token_count(mpiexec, tmp_path, n):
    """Set up for (H, T, K); sends of (H, t, K), t < T and t = 0 included, gather exactly
    on every transport, and a send past the setup is refused on every rank."""
    transports = ("host", "staged", "mpi-device", "ipc")
    status, lines, output = allgather_check(mpiexec, n, tmp_path, "--case", "tokens",
                                            "--transports", ",".join(transports))
    assert status == 0, output[-4000:]
    plans = (("int64", 5, (5, 2, 0, 1, 5, 3)), ("uint8", 8, (8, 3, 0, 8, 1, 5)))
    expected = sorted(
        [f"transport={name} asked={name} dtype={dtype} tokens={t} round={r}"
         for name in transports for dtype, _, counts in plans for r, t in enumerate(counts)]
        + [f"transport={name} asked={name} dtype={dtype} rejects tokens={most + 1}"
           for name in transports for dtype, most, _ in plans])
    for rank, text in lines.items():
        assert not problems(text), text
        assert sorted(oks(text)) == expected, f"rank {rank}:\n" + "\n".join(text)


@pytest.mark.parametrize("n, transport", [(2, None), (3, "staged"), (2, "ipc"), (3, "ipc")])
def test_plan_serves_token_counts_with_one_transport(mpiexec, tmp_path, n, transport):
    args = ["--tokens", "2,6,0,4,2"] + (["--transport", transport] if transport else [])
    status, lines, output = run_ranks(mpiexec, n, tmp_path / "plan", "plan_check.py", *args)
    assert status == 0, output[-4000:]
    name = transport or "host"  # the simulator's plans gather host arrays by default
    fused = name == "ipc"  # the default: fused wherever the transport allows it
    waits = " wait=kernel" if fused else ""  # the simulator's GPUs are unknown
    for rank, text in lines.items():
        assert not problems(text), text
        assert oks(text) == [f"transport={name} fused={fused} tokens={t}{waits}"
                             for t in (2, 6, 0, 4, 2)], text


@pytest.mark.parametrize("n, fused, wait, extra", [
    (1, "auto", "", ["--sparse-table"]),
    (2, "off", "", ["--sparse-table", "--merge", "owned", "--heads", "3"]),
    (2, "on", "merge", ["--method", "radix", "--query-len", "1"]),
    (3, "on", "kernel", ["--sparse-table", "--merge", "owned", "--heads", "3"]),
    (4, "on", "merge", ["--sparse-table", "--method", "radix"]),
    (5, "on", "", ["--merge", "owned"]),
    (8, "on", "merge", ["--sparse-table", "--tokens", "2,6,2"]),
], ids=["world1", "separate-2-table-owned", "fused-2-radix", "fused-3-table-owned",
        "fused-4-table-radix", "fused-5-owned", "fused-8-table"])
def test_fused_ipc_exchange_is_exact(mpiexec, tmp_path, n, fused, wait, extra):
    """The fused exchange (pack delivers into every rank, merge reads in place) against
    the oracle: every call alternates the buffer half, with the table, owned heads,
    both kernel families, query_len 2 (default) and 1, the merge's blocks waiting or a
    wait kernel before it (NUMBA_CP_IPC_WAIT; unset, the simulator's ranks, whose GPUs
    are unknown, wait in a kernel), at world 1 to 8."""
    tokens = "2,5,0,4,3" if "--query-len" in extra else "2,6,0,4,2"
    if "--tokens" in extra:
        tokens = extra[extra.index("--tokens") + 1]
    args = ["--transport", "ipc", "--fused", fused, *extra]
    if "--tokens" not in extra:
        args += ["--tokens", tokens]
    env = {"NUMBA_CP_IPC_WAIT": wait} if wait else None
    status, lines, output = run_ranks(mpiexec, n, tmp_path / "plan", "plan_check.py", *args,
                                      env=env)
    assert status == 0, output[-4000:]
    expect_fused = fused != "off" and n > 1
    waits = f" wait={wait or 'kernel'}" if expect_fused else ""
    for rank, text in lines.items():
        assert not problems(text), text
        assert oks(text) == [f"transport=ipc fused={expect_fused} tokens={t}{waits}"
                             for t in tokens.split(",")], text


@pytest.mark.parametrize("n, what", [(2, "shape"), (3, "dtype")])
def test_mismatched_setup_fails_on_every_rank(mpiexec, tmp_path, n, what):
    status, lines, output = allgather_check(mpiexec, n, tmp_path, "--case", "mismatch",
                                            "--what", what, "--transports", "staged")
    assert status != 0, output[-4000:]
    odd = ", ".join(str(r) for r in range(1, n, 2))
    even = ", ".join(str(r) for r in range(0, n, 2))
    variant = "((2, 4, 4), '<i8')" if what == "shape" else "((2, 3, 4), '<f2')"
    for rank, text in lines.items():
        errors = [line for line in text if " ERROR " in line]
        assert len(errors) == 1, f"rank {rank}: {text}"
        assert "RankAgreementError: staged setup: ranks disagree" in errors[0]
        assert f"((2, 3, 4), '<i8') on rank(s) {even}" in errors[0]
        assert f"{variant} on rank(s) {odd}" in errors[0]
        assert not oks(text)


@pytest.mark.parametrize("env, asked, expected", [
    ({}, "auto", "staged"),
    ({GPU_AWARE_ENV: "1"}, "auto", "mpi-device"),
    ({TRANSPORT_ENV: "mpi-device", GPU_AWARE_ENV: "0"}, "auto", "mpi-device"),
    ({TRANSPORT_ENV: "host"}, "auto-host", "host"),
], ids=["sim-default", "gpu-aware-env", "forced-env", "forced-host"])
def test_choice_under_mpiexec(mpiexec, tmp_path, env, asked, expected):
    status, lines, output = allgather_check(mpiexec, 2, tmp_path, "--transports", asked, env=env)
    assert status == 0, output[-4000:]
    for rank, text in lines.items():
        assert sorted(oks(text)) == values_labels(expected, asked), \
            f"rank {rank}:\n" + "\n".join(text)


def test_unknown_transport_env_under_mpiexec(mpiexec, tmp_path):
    status, lines, output = allgather_check(mpiexec, 2, tmp_path, "--case", "choose",
                                            env={TRANSPORT_ENV: "bogus"})
    assert status == 2, output[-4000:]
    for rank, text in lines.items():
        assert text[1:] == [f"rank={rank} ERROR ValueError: {TRANSPORT_ENV}='bogus': unknown "
                            f"transport; choose one of {CHOICES}"], text


def test_main_job_ipc_graph_is_exact(mpiexec, tmp_path):
    out = tmp_path / "ipc.json"
    command = [*mpiexec, "-n", "3", sys.executable, str(ROOT / "launch" / "exchange.py"),
               "--heads", "2", "--batch", "3", "--context", "4K", "--topk", "8", "--iters", "1",
               "--warmup", "1", "--transport", "ipc", "--graph", "--sparse-table",
               "--json", str(out)]
    status, output = run_mpiexec(command, env=script_env(), cwd=ROOT)
    assert status == 0, output[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 3 and result["exact"] is True
    assert result["transport"].startswith("ipc (forced")
    assert "graph_replay" in result["stages"]


@pytest.mark.parametrize("n, nodes, extra", [
    (2, "1", []),
    (2, "2", ["--sparse-table"]),
    (4, "2", ["--sparse-table", "--merge", "owned", "--heads", "3"]),
    (4, "3,1", ["--transport", "ipc", "--method", "radix", "--fused", "off"]),
    (5, "3", ["--query-len", "1", "--tokens", "2,5,0,4,3"]),
    (6, "3", ["--topk", "8"]),
    (8, "1,3,4", ["--sparse-table", "--tokens", "2,6,2"]),
    (4, "4", ["--tokens", "2,6,2"]),
], ids=["one-node-2", "two-nodes-2-table", "two-nodes-4-table-owned", "uneven-4-ipc-radix",
        "uneven-5-query1", "three-nodes-6", "uneven-8-table", "rank-per-node-4"])
def test_two_level_exchange_is_exact(mpiexec, tmp_path, n, nodes, extra):
    """hierarchy="node" with pretend nodes (NUMBA_CP_NODES): every call equals the
    unsharded oracle (as the flat exchange does), uneven nodes and one rank per node
    included; the plan reports the nodes it used."""
    check_two_level(mpiexec, tmp_path, n, nodes, extra, fused=False)


@pytest.mark.parametrize("n, nodes, wait, extra", [
    (2, "1", "merge", ["--sparse-table"]),
    (3, "2,1", "kernel", ["--method", "radix", "--alternate", "--capture"]),
    (4, "2", "merge", ["--sparse-table", "--merge", "owned", "--heads", "3", "--alternate",
                       "--capture"]),
    (5, "3", "", ["--query-len", "1", "--tokens", "2,5,0,4,3", "--method", "radix"]),
    (6, "1,2,3", "merge", ["--sparse-table", "--topk", "8", "--tokens", "2,6,2"]),
    (8, "4", "kernel", ["--sparse-table", "--method", "radix", "--tokens", "2,6,2"]),
], ids=["one-node-2-table", "uneven-3-radix-alternate", "two-nodes-4-table-owned-alternate",
        "three-nodes-5-query1-radix", "uneven-6-table", "four-nodes-8-table-radix"])
def test_two_level_exchange_with_fused_node_level_is_exact(mpiexec, tmp_path, n, nodes, wait,
                                                           extra):
    """hierarchy="node" over IPC inside each pretend node: the node level runs fused (the
    pack delivers into the node's ranks, a merge keeps the node's keys in place), and
    every call equals the unsharded oracle, at world 2 to 8 on 1 to 4 nodes, uneven ones
    included, with the table, owned heads, both kernel families, the merge's blocks
    waiting or a wait kernel before it, fused calls alternating with step-by-step
    (separate) ones on one plan, and captured exchanges (the node level and the last
    merge as two graphs around the nodes' gather) replayed among them."""
    env = {"NUMBA_CP_IPC_WAIT": wait} if wait else {}
    check_two_level(mpiexec, tmp_path, n, nodes,
                    ["--transport", "ipc", "--fused", "on", *extra], fused=True, env=env,
                    wait=wait or "kernel")  # unset: the simulator's GPUs are unknown


def check_two_level(mpiexec, tmp_path, n, nodes, extra, fused, env=(), wait=None):
    tokens = extra[extra.index("--tokens") + 1] if "--tokens" in extra else "2,6,0,4,2"
    status, lines, output = run_ranks(mpiexec, n, tmp_path / "plan", "plan_check.py",
                                      "--hierarchy", "node", *extra,
                                      env={"NUMBA_CP_NODES": nodes, **dict(env)})
    assert status == 0, output[-4000:]
    sizes = nodes.split(",")
    if len(sizes) == 1:  # a node count: as even as it goes, the first nodes one rank more
        count = int(nodes)
        sizes = [str(n // count + (k < n % count)) for k in range(count)]
    for rank, text in lines.items():
        assert not problems(text), text
        got = oks(text)
        assert len(got) == len(tokens.split(",")), text
        for line, t in zip(got, tokens.split(",")):
            assert f"fused={fused} tokens={t} two-level:" in line, line
            assert f"{len(sizes)} node(s) of {','.join(sizes)} rank(s)" in line, line
            assert line.endswith(f" wait={wait}" if fused else "rank(s)"), line
