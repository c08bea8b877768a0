"""tools/cost_model.py: the flat and two-level exchange model and its command line."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "cost_model.py"

_spec = importlib.util.spec_from_file_location("cost_model", SCRIPT)
cm = importlib.util.module_from_spec(_spec)
sys.modules["cost_model"] = cm  # dataclasses look their module up by name
_spec.loader.exec_module(cm)

PLATFORMS = sorted(cm.PLATFORMS)
CASES = sorted(cm.CASES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_one_node_two_level_is_flat(platform, case):
    for world in (2, 4, 8):
        assert cm.two_level_us(world, 1, platform, case) == pytest.approx(
            cm.flat_us(world, 1, platform, case), rel=1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("algorithm", cm.ALGORITHMS)
def test_one_rank_per_node_two_level_is_flat(platform, case, algorithm):
    for world in cm.WORLDS:
        if world > 32:
            continue  # nodes stop at 32
        assert cm.two_level_us(world, world, platform, case, algorithm) == pytest.approx(
            cm.flat_us(world, world, platform, case, algorithm), rel=1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_full_nodes_grow_with_world_and_two_level_wins(platform, case):
    r = cm.PLATFORMS[platform].ranks_per_node
    worlds = [w for w in cm.WORLDS if w // r in cm.NODES]
    flat = [cm.flat_us(w, w // r, platform, case) for w in worlds]
    two = [cm.two_level_us(w, w // r, platform, case) for w in worlds]
    assert all(b > a for a, b in zip(flat, flat[1:])), flat
    assert all(b >= a for a, b in zip(two, two[1:])), two
    saving = [f - t for f, t in zip(flat, two)]
    assert saving[0] == pytest.approx(0.0, abs=1e-9)  # world 8 is one node
    assert all(s > 0 for s in saving[1:]), saving
    assert all(b > a for a, b in zip(saving[1:], saving[2:])), saving


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_inter_node_bytes_shrink_by_ranks_per_node(platform, case):
    payload = cm.CASES[case].payload_bytes
    for world, nodes in cm.grid(platform):
        r = world // nodes
        flat = cm.inter_node_bytes(world, nodes, platform, case, "flat")
        two = cm.inter_node_bytes(world, nodes, platform, case, "node")
        assert flat == (world - r) * payload
        assert two == (nodes - 1) * payload
        if nodes > 1:
            assert flat == r * two


def test_payloads_match_the_cases():
    assert cm.CASES["b"].payload_bytes == 4 * 64 * 16 * 8 == 32 * 1024
    assert cm.CASES["e"].payload_bytes == 4 * 32 * 128 * 8 == 128 * 1024


def test_kernel_model_reproduces_the_measured_points():
    # case b packs 256 columns per row at world 4 (3.5 µs), case e 2048 (9.0 µs)
    assert cm.pack_us("b", 4) == pytest.approx(3.5)
    assert cm.pack_us("e", 4) == pytest.approx(9.0)
    assert cm.merge_us("b", 64) == pytest.approx(2.7)
    assert cm.merge_us("e", 512) == pytest.approx(3.7)
    assert cm.merge_us("b", 512) == pytest.approx(4.0)  # case d's merge, same grid
    assert cm.pack_us("b", 16) == pytest.approx(2.7)    # case a's pack, 64 columns
    assert cm.pack_us("b", 10 ** 6) >= cm.FLOOR_US
    assert cm.merge_us("b", 1) >= cm.FLOOR_US


def test_alpha_beta_formulas():
    m, a, b = 32768, 2.0, 50.0
    assert cm.allgather_rd_us(8, m, a, b) == pytest.approx(3 * a + 7 * m / (b * 1e3))
    assert cm.allgather_rd_us(6, m, a, b) == pytest.approx(3 * a + 5 * m / (b * 1e3))
    assert cm.allgather_ring_us(8, m, a, b) == pytest.approx(7 * (a + m / (b * 1e3)))
    assert cm.allgather_rd_us(1, m, a, b) == 0.0
    assert cm.intra_node_us("h200-ib", 1, m) == 0.0
    p = cm.PLATFORMS["mi300x-ib"]
    assert cm.intra_node_us(p, 8, m) == pytest.approx(
        p.alpha_flag_us + max(7 * m / (p.beta_egress_gbs * 1e3), m / (p.beta_peer_gbs * 1e3)))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_steps_of_both_exchanges(platform):
    p, c = cm.PLATFORMS[platform], cm.CASES["b"]
    world, nodes, r, m = 64, 8, 8, c.payload_bytes
    flat = cm.flat_breakdown(world, nodes, platform, "b", "rd")
    assert flat["algorithm"] == "rd"
    assert flat["steps"] == pytest.approx({
        "pack": cm.pack_us("b", world),
        "host_step": c.host_step_us,
        # log2 R rounds in the node, log2 N across nodes with the NICs shared by R ranks
        "inter_node": 3 * p.alpha_flag_us + 7 * m / (p.beta_peer_gbs * 1e3)
        + 3 * p.alpha_net_us + 56 * m / (min(p.beta_nic_gbs, p.nics_per_node
                                              * p.beta_nic_gbs / r) * 1e3),
        "merge": cm.merge_us("b", world * c.topk),
    })
    two = cm.two_level_breakdown(world, nodes, platform, "b", "rd")
    assert two["algorithm"] == "rd"
    assert two["steps"] == pytest.approx({
        "pack": cm.pack_us("b", world),
        "intra_node": cm.intra_node_us(platform, r, m),
        "node_merge": cm.merge_us("b", r * c.topk),
        "host_step": c.host_step_us,
        "inter_node": cm.allgather_rd_us(nodes, m, p.alpha_net_us,
                                         p.beta_net_per_rank_gbs(r)),
        "merge": cm.merge_us("b", nodes * c.topk),
    })
    assert flat["total_us"] == pytest.approx(sum(flat["steps"].values()))
    assert cm.flat_us(world, nodes, platform, "b", "rd") == flat["total_us"]
    assert cm.two_level_us(world, nodes, platform, "b", "rd") == two["total_us"]


def test_nic_sharing():
    assert cm.PLATFORMS["h200-ib"].beta_net_per_rank_gbs(8) == 50.0
    assert cm.PLATFORMS["mi250x-slingshot"].beta_net_per_rank_gbs(8) == 12.5
    assert cm.PLATFORMS["mi250x-slingshot"].beta_net_per_rank_gbs(2) == 25.0


def test_best_algorithm_is_the_cheaper_one():
    for world, nodes in cm.grid("mi250x-slingshot"):
        if nodes == 1:
            continue
        best, _ = cm.flat_allgather_us(world, nodes, "mi250x-slingshot", 131072, "best")
        rd, _ = cm.flat_allgather_us(world, nodes, "mi250x-slingshot", 131072, "rd")
        ring, _ = cm.flat_allgather_us(world, nodes, "mi250x-slingshot", 131072, "ring")
        assert best == pytest.approx(min(rd, ring))


def test_host_step_adds_to_both_across_nodes_only():
    for host in (0.0, 50.0):
        assert cm.flat_us(8, 1, host_step_us=host) == cm.flat_us(8, 1)
    d_flat = cm.flat_us(64, 8, host_step_us=50.0) - cm.flat_us(64, 8, host_step_us=0.0)
    d_two = cm.two_level_us(64, 8, host_step_us=50.0) - cm.two_level_us(64, 8, host_step_us=0.0)
    assert d_flat == pytest.approx(50.0)
    assert d_two == pytest.approx(50.0)


def test_validation_against_our_measurements():
    v = cm.validation("b")
    assert v["world1"]["measured_graph_us"] == 10.5
    assert 0.8 < v["world1"]["model_over_measured"] < 1.2
    assert [s["world"] for s in v["shared_gpu"]] == [2, 4, 8]
    for s in v["shared_gpu"]:
        assert 0.8 < s["model_over_measured"] < 1.2, s
        # serialized kernels can never be cheaper than the same kernels with nothing exchanged
        assert s["model_serialized_us"] > s["measured_alone_us"]
    e = cm.validation("e")
    for s in e["shared_gpu"]:
        assert s["model_over_measured"] >= 1.0, s  # an upper bound for case e


@pytest.mark.parametrize("call, name", [
    (lambda: cm.flat_us(0, 1), "world"),
    (lambda: cm.flat_us(8.0, 1), "world"),
    (lambda: cm.flat_us(8, 0), "nodes"),
    (lambda: cm.flat_us(8, 3), "nodes"),
    (lambda: cm.two_level_us(64, 2), "ranks per node"),
    (lambda: cm.flat_us(8, 1, platform="h100-nvl"), "platform"),
    (lambda: cm.two_level_us(8, 1, case="z"), "case"),
    (lambda: cm.flat_us(16, 2, algorithm="tree"), "algorithm"),
    (lambda: cm.inter_node_bytes(16, 2, "h200-ib", "b", "rack"), "hierarchy"),
    (lambda: cm.merge_us("b", 0), "candidates"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_script_prints_table_checks_and_one_line_per_platform(tmp_path):
    out = tmp_path / "model.json"
    proc = _run("--case", "b", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "world nodes  R   flat us 2-level us  ratio" in text
    for name in PLATFORMS:
        assert f"\n{name}: " in text
        assert sum(line.startswith(f"{name}, case b: two-level wins")
                   for line in text.splitlines()) == 1
    assert "check, case b: world 1" in text
    # the world-256 row of the first platform, recomputed from the functions
    row = next(line for line in text.splitlines() if line.split()[:3] == ["256", "32", "8"])
    assert float(row.split()[3]) == pytest.approx(cm.flat_us(256, 32, "h200-ib", "b"), abs=0.05)
    assert float(row.split()[4]) == pytest.approx(cm.two_level_us(256, 32, "h200-ib", "b"),
                                                  abs=0.05)

    data = json.loads(out.read_text())
    assert data["case"] == "b" and data["algorithm"] == "best"
    assert set(data["tables"]) == set(PLATFORMS) == set(data["summaries"])
    rows = data["tables"]["h200-ib"]
    assert [(r["world"], r["nodes"]) for r in rows] == cm.grid("h200-ib")
    assert len(rows) == 18
    for r in rows:
        assert set(r) >= {"world", "nodes", "ranks_per_node", "flat_us", "two_level_us",
                          "ratio", "saving_us", "flat_inter_bytes", "two_level_inter_bytes",
                          "flat_algorithm", "two_level_algorithm", "flat_steps_us",
                          "two_level_steps_us"}
        assert math.isclose(sum(r["flat_steps_us"].values()), r["flat_us"], abs_tol=0.01)
        assert r["ratio"] == pytest.approx(r["flat_us"] / r["two_level_us"], rel=1e-3)
    assert data["constants"]["cases"]["b"]["payload_bytes"] == 32768
    assert data["validation"]["case"] == "b"


def test_script_one_platform_and_case_e():
    proc = _run("--case", "e", "--platform", "mi250x-slingshot", "--algorithm", "rd")
    assert proc.returncode == 0, proc.stderr
    assert "\nmi250x-slingshot: " in proc.stdout
    assert "\nh200-ib: " not in proc.stdout          # the table of one platform only
    assert "h200-ib, case e: two-level wins" in proc.stdout  # but every summary line
    assert " ring" not in proc.stdout.split("check, case e")[0]


@pytest.mark.parametrize("args, name", [
    (("--case", "q"), "case"),
    (("--platform", "tpu"), "platform"),
    (("--algorithm", "tree"), "algorithm"),
    (("--host-step-us", "-1"), "host_step_us"),
])
def test_script_refuses_bad_arguments(args, name):
    proc = _run(*args)
    assert proc.returncode == 2
    assert name in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plot_only_when_matplotlib_is_there(tmp_path):
    png = tmp_path / "model.png"
    proc = _run("--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    if importlib.util.find_spec("matplotlib") is None:
        assert not png.exists()
        assert "matplotlib is not installed" in proc.stderr
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
