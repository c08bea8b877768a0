"""Cost model of one candidate exchange: flat against two-level, world 8 to 256.

    python tools/cost_model.py [--case b|e] [--platform h200-ib|h200-slingshot|mi300x-ib|
                               mi250x-slingshot|all] [--algorithm best|rd|ring]
                               [--json out.json] [--plot out.png]

Prints, for every (world, nodes) pair of world 8..256 and nodes 1..32 (powers of two)
that a platform's nodes can hold, the modelled µs per exchange of the flat exchange and
of the two-level exchange (``hierarchy="node"``), their ratio and the bytes each rank
receives over the network; then the model's check against the measured kernels and
the shared-GPU exchange; then one line per platform saying where two-level wins and by
how much. ``docs/scaling.md`` derives every formula and cites every constant.

The two exchanges, with P ranks on N nodes of R = P / N ranks and m the bytes one rank
packs (heads * rows * topk * 8):

flat
    pack; then, on one node, the fused IPC exchange (pack stores into every peer,
    flags, merge reads in place), across nodes one MPI all-gather over all P ranks
    (every rank receives (P - 1) * m); then a merge of P * topk candidates per row.
two-level
    pack; the fused IPC exchange inside the node and a merge of R * topk candidates to
    the node's topk keys; then one MPI all-gather of those keys across the N nodes
    (R such gathers run side by side, one per local rank; every rank receives
    (N - 1) * m); then a merge of N * topk candidates.

Times in µs, bandwidths in GB/s (1e9 bytes per second), sizes in bytes. Pure Python and
numpy; matplotlib only for ``--plot``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

# ---------------------------------------------------------------------------
# Constants. Measured ones come from BENCHMARKS.md (one NVIDIA H200, 2026-12-03);
# published ones are cited in docs/scaling.md under the name given here.


@dataclasses.dataclass(frozen=True)
class Case:
    """A benchmark case and the kernel times measured for it on one H200."""

    name: str
    context: str
    heads: int
    rows: int              # batch * query_len
    topk: int
    global_blocks: int     # context / 128
    pack_ref_us: float     # pack device µs measured at pack_ref_cols columns per row
    pack_ref_cols: int
    pack_slope_us: float   # µs per extra column per row (see pack_us)
    merge_ref_us: float    # merge device µs measured at merge_ref_cands candidates per row
    merge_ref_cands: int
    world1_graph_us: float  # whole exchange at world 1 as one CUDA graph (measured)
    host_step_us: float    # one return to the host between two graphs (measured)

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank packs and sends: heads * rows * topk int64 keys."""
        return self.heads * self.rows * self.topk * 8


FLOOR_US = 1.4  # launch + one memory round trip on the pack's grid (case b; 1.3-1.7 over cases)
# Merge cost per extra candidate per row: cases b and d share the grid (64 rows x 4 heads)
# and merge 64 and 512 candidates per row in 2.7 and 4.0 µs.
MERGE_SLOPE_US = (4.0 - 2.7) / (512 - 64)

CASES = {
    "b": Case(
        name="b", context="128K", heads=4, rows=64, topk=16, global_blocks=1024,
        pack_ref_us=3.5, pack_ref_cols=256,
        # Cases a and b share the grid and topk and pack 64 and 256 columns per row
        # in 2.7 and 3.5 µs.
        pack_slope_us=(3.5 - 2.7) / (256 - 64),
        merge_ref_us=2.7, merge_ref_cands=64,
        world1_graph_us=10.5,
        host_step_us=17.5 - 10.5,  # world 1: iteration µs - replay µs
    ),
    "e": Case(
        name="e", context="1M", heads=4, rows=32, topk=128, global_blocks=8192,
        pack_ref_us=9.0, pack_ref_cols=2048,
        # No second case shares e's grid: the pack is taken linear through the floor.
        pack_slope_us=(9.0 - FLOOR_US) / 2048,
        merge_ref_us=3.7, merge_ref_cands=512,
        world1_graph_us=30.3,
        host_step_us=37.6 - 30.3,
    ),
}

# Per-exchange µs measured with all ranks sharing ONE H200 under CUDA MPS (back-to-back
# graph replays, slowest rank). These never crossed NVLink.
MEASURED_SHARED = {
    "b": {"fused": {2: 16.3, 4: 35.6, 8: 54.8}, "separate": {2: 21.8, 4: 38.9, 8: 60.6},
          "staged": {2: 359.4, 4: 447.0, 8: 475.3}, "alone": {2: 9.6, 4: 13.0, 8: 19.5}},
    "e": {"fused": {2: 36.3, 4: 50.0, 8: 69.8}, "separate": {2: 45.3, 4: 60.2, 8: 88.1},
          "staged": {2: 274.9, 4: 465.8, 8: 732.4}, "alone": {2: 32.3, 4: 29.1, 8: 33.5}},
}


@dataclasses.dataclass(frozen=True)
class Platform:
    """A node type and its network, from published figures (docs/scaling.md)."""

    name: str
    description: str
    ranks_per_node: int      # one rank per GPU (per GCD on MI250X)
    alpha_flag_us: float     # one-sided store + flag visible to a peer in the node
    beta_peer_gbs: float     # one direction, one pair of GPUs in the node
    beta_egress_gbs: float   # one direction, one GPU to all its peers together
    alpha_net_us: float      # one inter-node message step
    beta_nic_gbs: float      # one direction, one NIC
    nics_per_node: int

    def beta_net_per_rank_gbs(self, ranks_sending: int) -> float:
        """Bandwidth one rank gets when ``ranks_sending`` ranks of its node send at once."""
        return min(self.beta_nic_gbs, self.nics_per_node * self.beta_nic_gbs / ranks_sending)


NCCL_NVLINK_LL_US = 0.6   # NCCL tuner: NVLink hardware latency per step, LL protocol
RCCL_XGMI_LL_US = 0.8     # RCCL tuner: XGMI hardware latency per step, LL protocol
NCCL_NET_LL_US = 2.7      # NCCL tuner: network hardware latency per ring step, LL protocol

PLATFORMS = {
    "h200-ib": Platform(
        name="h200-ib", description="HGX H200, NVLink 4 + NVSwitch, 8x InfiniBand NDR 400G",
        ranks_per_node=8, alpha_flag_us=NCCL_NVLINK_LL_US, beta_peer_gbs=396.4,
        beta_egress_gbs=396.4, alpha_net_us=NCCL_NET_LL_US, beta_nic_gbs=50.0,
        nics_per_node=8),
    "h200-slingshot": Platform(
        name="h200-slingshot", description="HGX H200, NVLink 4 + NVSwitch, 8x Slingshot-11 200G",
        ranks_per_node=8, alpha_flag_us=NCCL_NVLINK_LL_US, beta_peer_gbs=396.4,
        beta_egress_gbs=396.4, alpha_net_us=NCCL_NET_LL_US, beta_nic_gbs=25.0,
        nics_per_node=8),
    "mi300x-ib": Platform(
        name="mi300x-ib", description="8x MI300X, XGMI (7 links), 8x InfiniBand NDR 400G",
        ranks_per_node=8, alpha_flag_us=RCCL_XGMI_LL_US, beta_peer_gbs=64.0,
        beta_egress_gbs=448.0, alpha_net_us=NCCL_NET_LL_US, beta_nic_gbs=50.0,
        nics_per_node=8),
    "mi250x-slingshot": Platform(
        name="mi250x-slingshot",
        description="Frontier-like: 4x MI250X = 8 GCDs, Infinity Fabric, 4x Slingshot-11 200G",
        ranks_per_node=8, alpha_flag_us=RCCL_XGMI_LL_US, beta_peer_gbs=50.0,
        beta_egress_gbs=350.0, alpha_net_us=NCCL_NET_LL_US, beta_nic_gbs=25.0,
        nics_per_node=4),
}

ALGORITHMS = ("best", "rd", "ring")
WORLDS = tuple(2 ** k for k in range(3, 9))   # 8 .. 256
NODES = tuple(2 ** k for k in range(0, 6))    # 1 .. 32


# ---------------------------------------------------------------------------
# Argument checks: every public function names the argument it refuses.


def _case(case) -> Case:
    if isinstance(case, Case):
        return case
    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    return CASES[case]


def _platform(platform) -> Platform:
    if isinstance(platform, Platform):
        return platform
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {sorted(PLATFORMS)}, got {platform!r}")
    return PLATFORMS[platform]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


def _layout(world, nodes, platform: Platform) -> tuple[int, int, int]:
    world = _positive_int("world", world)
    nodes = _positive_int("nodes", nodes)
    if world % nodes:
        raise ValueError(f"nodes must divide world: world {world}, nodes {nodes}")
    per_node = world // nodes
    if per_node > platform.ranks_per_node:
        raise ValueError(f"world / nodes = {per_node} ranks per node exceeds the "
                         f"{platform.ranks_per_node} GPUs of a {platform.name} node "
                         f"(world {world}, nodes {nodes})")
    return world, nodes, per_node


def _log2_ceil(n: int) -> int:
    return max(0, math.ceil(math.log2(n)))


# ---------------------------------------------------------------------------
# Kernels (from our H200 measurements).


def pack_us(case, world) -> float:
    """Pack device µs of one rank holding ceil(global_blocks / world) columns per row."""
    c = _case(case)
    world = _positive_int("world", world)
    cols = math.ceil(c.global_blocks / world)
    return max(FLOOR_US, c.pack_ref_us + c.pack_slope_us * (cols - c.pack_ref_cols))


def merge_us(case, candidates) -> float:
    """Merge device µs for ``candidates`` keys per (head, row)."""
    c = _case(case)
    candidates = _positive_int("candidates", candidates)
    return max(FLOOR_US, c.merge_ref_us + MERGE_SLOPE_US * (candidates - c.merge_ref_cands))


# ---------------------------------------------------------------------------
# Communication.


def intra_node_us(platform, ranks_per_node, payload_bytes) -> float:
    """Fused IPC exchange among one node's ranks, one rank per GPU.

    Every pack stores its m bytes into each of the R - 1 peers at once, then one flag:
    alpha_flag + max((R - 1) * m / beta_egress, m / beta_peer). Zero for R == 1.
    """
    p = _platform(platform)
    r = _positive_int("ranks_per_node", ranks_per_node)
    m = _positive_int("payload_bytes", payload_bytes)
    if r == 1:
        return 0.0
    transfer = max((r - 1) * m / (p.beta_egress_gbs * 1e3), m / (p.beta_peer_gbs * 1e3))
    return p.alpha_flag_us + transfer


def allgather_rd_us(n, payload_bytes, alpha_us, beta_gbs) -> float:
    """Recursive doubling (Bruck when n is not a power of two), Thakur et al. 2005:
    ceil(log2 n) * alpha + (n - 1) * m / beta."""
    n = _positive_int("n", n)
    m = _positive_int("payload_bytes", payload_bytes)
    return _log2_ceil(n) * alpha_us + (n - 1) * m / (beta_gbs * 1e3)


def allgather_ring_us(n, payload_bytes, alpha_us, beta_gbs) -> float:
    """Ring, Thakur et al. 2005: (n - 1) * alpha + (n - 1) * m / beta."""
    n = _positive_int("n", n)
    m = _positive_int("payload_bytes", payload_bytes)
    return (n - 1) * (alpha_us + m / (beta_gbs * 1e3))


def flat_allgather_us(world, nodes, platform, payload_bytes, algorithm="best"):
    """One MPI all-gather over all P ranks across N > 1 nodes. Returns (µs, algorithm).

    Ranks are numbered node by node. Recursive doubling then takes log2 R rounds inside
    the node (alpha_flag, one peer's bandwidth) and log2 N rounds across nodes, where all
    R ranks of a node send at once and share its NICs. A ring takes P - 1 steps, and each
    waits for the one rank per node whose neighbour is on the next node (one NIC).
    """
    p = _platform(platform)
    world, nodes, r = _layout(world, nodes, p)
    algorithm = _algorithm(algorithm)
    m = _positive_int("payload_bytes", payload_bytes)
    rd = (_log2_ceil(r) * p.alpha_flag_us + (r - 1) * m / (p.beta_peer_gbs * 1e3)
          + _log2_ceil(nodes) * p.alpha_net_us
          + (world - r) * m / (p.beta_net_per_rank_gbs(r) * 1e3))
    ring = allgather_ring_us(world, m, p.alpha_net_us, p.beta_nic_gbs)
    return _pick(algorithm, rd, ring)


def node_allgather_us(world, nodes, platform, payload_bytes, algorithm="best"):
    """Two-level's inter-node step: R all-gathers side by side, each over the N ranks of
    one local rank, each rank sending its node's m bytes. Returns (µs, algorithm)."""
    p = _platform(platform)
    world, nodes, r = _layout(world, nodes, p)
    algorithm = _algorithm(algorithm)
    beta = p.beta_net_per_rank_gbs(r)
    rd = allgather_rd_us(nodes, payload_bytes, p.alpha_net_us, beta)
    ring = allgather_ring_us(nodes, payload_bytes, p.alpha_net_us, beta)
    return _pick(algorithm, rd, ring)


def _pick(algorithm, rd, ring):
    if algorithm == "rd" or (algorithm == "best" and rd <= ring):
        return rd, "rd"
    return ring, "ring"


def inter_node_bytes(world, nodes, platform, case, hierarchy):
    """Bytes one rank receives over the network per exchange (0 on one node)."""
    p = _platform(platform)
    c = _case(case)
    world, nodes, r = _layout(world, nodes, p)
    if hierarchy == "flat":
        return (world - r) * c.payload_bytes
    if hierarchy == "node":
        return (nodes - 1) * c.payload_bytes
    raise ValueError(f"hierarchy must be 'flat' or 'node', got {hierarchy!r}")


# ---------------------------------------------------------------------------
# Whole exchanges.


def flat_breakdown(world, nodes, platform, case, algorithm="best", host_step_us=None) -> dict:
    """µs of each step of the flat exchange (and the MPI algorithm picked)."""
    p = _platform(platform)
    c = _case(case)
    world, nodes, r = _layout(world, nodes, p)
    host = c.host_step_us if host_step_us is None else float(host_step_us)
    m = c.payload_bytes
    steps = {"pack": pack_us(c, world)}
    if nodes == 1:
        steps["intra_node"] = intra_node_us(p, r, m)
        algo = "ipc"
    else:
        steps["host_step"] = host
        steps["inter_node"], algo = flat_allgather_us(world, nodes, p, m, algorithm)
    steps["merge"] = merge_us(c, world * c.topk)
    return {"steps": steps, "total_us": sum(steps.values()), "algorithm": algo}


def two_level_breakdown(world, nodes, platform, case, algorithm="best",
                        host_step_us=None) -> dict:
    """µs of each step of the two-level exchange (and the MPI algorithm picked)."""
    p = _platform(platform)
    c = _case(case)
    world, nodes, r = _layout(world, nodes, p)
    host = c.host_step_us if host_step_us is None else float(host_step_us)
    m = c.payload_bytes
    steps = {"pack": pack_us(c, world)}
    if r > 1:
        steps["intra_node"] = intra_node_us(p, r, m)
        steps["node_merge"] = merge_us(c, r * c.topk)
    algo = "ipc" if nodes == 1 else None
    if nodes > 1:
        steps["host_step"] = host
        steps["inter_node"], algo = node_allgather_us(world, nodes, p, m, algorithm)
        steps["merge"] = merge_us(c, nodes * c.topk)
    return {"steps": steps, "total_us": sum(steps.values()), "algorithm": algo}


def flat_us(world, nodes, platform="h200-ib", case="b", algorithm="best",
            host_step_us=None) -> float:
    """Modelled µs per flat exchange."""
    return flat_breakdown(world, nodes, platform, case, algorithm, host_step_us)["total_us"]


def two_level_us(world, nodes, platform="h200-ib", case="b", algorithm="best",
                 host_step_us=None) -> float:
    """Modelled µs per two-level exchange (hierarchy="node")."""
    return two_level_breakdown(world, nodes, platform, case, algorithm,
                               host_step_us)["total_us"]


def grid(platform) -> list[tuple[int, int]]:
    """(world, nodes) pairs of world 8..256 and nodes 1..32 that the platform's nodes hold."""
    p = _platform(platform)
    return [(w, n) for w in WORLDS for n in NODES
            if n <= w and w % n == 0 and w // n <= p.ranks_per_node]


def table(platform, case, algorithm="best", host_step_us=None) -> list[dict]:
    """One row per grid point."""
    p = _platform(platform)
    c = _case(case)
    rows = []
    for world, nodes in grid(p):
        fl = flat_breakdown(world, nodes, p, c, algorithm, host_step_us)
        tl = two_level_breakdown(world, nodes, p, c, algorithm, host_step_us)
        rows.append({
            "platform": p.name, "case": c.name, "world": world, "nodes": nodes,
            "ranks_per_node": world // nodes,
            "flat_us": round(fl["total_us"], 3), "two_level_us": round(tl["total_us"], 3),
            "ratio": round(fl["total_us"] / tl["total_us"], 4),
            "saving_us": round(fl["total_us"] - tl["total_us"], 3),
            "flat_inter_bytes": inter_node_bytes(world, nodes, p, c, "flat"),
            "two_level_inter_bytes": inter_node_bytes(world, nodes, p, c, "node"),
            "flat_algorithm": fl["algorithm"], "two_level_algorithm": tl["algorithm"],
            "flat_steps_us": {k: round(v, 3) for k, v in fl["steps"].items()},
            "two_level_steps_us": {k: round(v, 3) for k, v in tl["steps"].items()},
        })
    return rows


def summary(platform, case, algorithm="best", host_step_us=None) -> dict:
    """Where two-level wins on a platform, and by how much."""
    rows = table(platform, case, algorithm, host_step_us)
    multi = [r for r in rows if r["nodes"] > 1 and r["ranks_per_node"] > 1]
    wins = [r for r in multi if r["saving_us"] > 0]
    losses = [r for r in multi if r["saving_us"] < 0]
    full = [r for r in rows if r["ranks_per_node"] == _platform(platform).ranks_per_node
            and r["nodes"] > 1]
    best = max(full, key=lambda r: r["ratio"])
    first = min(full, key=lambda r: r["world"])
    text = (f"{_platform(platform).name}, case {_case(case).name}: two-level wins at "
            f"{len(wins)} of the {len(multi)} multi-node points with several ranks per node")
    if losses:
        text += " and loses at " + ", ".join(
            f"world {r['world']}/nodes {r['nodes']} ({-r['saving_us']:.1f} µs)" for r in losses)
    text += (f"; equal at 1 node or 1 rank per node. Full nodes: "
             f"{first['saving_us']:.1f} µs faster ({first['ratio']:.2f}x) at world "
             f"{first['world']} on {first['nodes']} nodes, "
             f"{best['saving_us']:.1f} µs faster ({best['ratio']:.2f}x; "
             f"{best['flat_us']:.1f} -> {best['two_level_us']:.1f} µs) at world "
             f"{best['world']} on {best['nodes']} nodes.")
    return {"platform": _platform(platform).name, "case": _case(case).name,
            "wins": len(wins), "losses": len(losses), "multi_node_points": len(multi),
            "full_node_first": first, "full_node_best": best, "text": text}


# ---------------------------------------------------------------------------
# Check against our measurements (one H200).


def world1_model_us(case) -> float:
    """Kernel model at world 1 (pack over all columns, merge of topk): compare with the
    measured one-graph world-1 exchange, which also holds one graph launch."""
    c = _case(case)
    return pack_us(c, 1) + merge_us(c, c.topk)


def shared_gpu_us(case, world, wait_kernel_us=FLOOR_US) -> float:
    """Upper-bound model of the fused exchange with all ``world`` ranks sharing ONE GPU:
    every rank's pack, wait kernel and merge run one after the other (no NVLink)."""
    c = _case(case)
    world = _positive_int("world", world)
    return world * (pack_us(c, world) + wait_kernel_us + merge_us(c, world * c.topk))


def validation(case) -> dict:
    """Model against the measurements that one GPU can give."""
    c = _case(case)
    shared = []
    for world, measured in MEASURED_SHARED[c.name]["fused"].items():
        model = shared_gpu_us(c, world)
        shared.append({"world": world, "model_serialized_us": round(model, 2),
                       "measured_fused_us": measured,
                       "measured_alone_us": MEASURED_SHARED[c.name]["alone"][world],
                       "model_over_measured": round(model / measured, 3)})
    w1 = world1_model_us(c)
    return {"case": c.name,
            "world1": {"model_kernels_us": round(w1, 2), "measured_graph_us": c.world1_graph_us,
                       "model_over_measured": round(w1 / c.world1_graph_us, 3)},
            "shared_gpu": shared}


def constants() -> dict:
    return {"floor_us": FLOOR_US, "merge_slope_us_per_candidate": MERGE_SLOPE_US,
            "cases": {k: dataclasses.asdict(v) | {"payload_bytes": v.payload_bytes}
                      for k, v in CASES.items()},
            "platforms": {k: dataclasses.asdict(v) for k, v in PLATFORMS.items()}}


# ---------------------------------------------------------------------------
# Output.


def format_table(rows) -> str:
    head = (f"{'world':>5} {'nodes':>5} {'R':>2} {'flat us':>9} {'2-level us':>10} "
            f"{'ratio':>6} {'saved us':>8} {'flat net KiB':>12} {'2-lvl net KiB':>13} "
            f"{'flat alg':>8} {'2-lvl alg':>9}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['world']:>5} {r['nodes']:>5} {r['ranks_per_node']:>2} {r['flat_us']:>9.1f} "
            f"{r['two_level_us']:>10.1f} {r['ratio']:>6.2f} {r['saving_us']:>8.1f} "
            f"{r['flat_inter_bytes'] / 1024:>12.0f} {r['two_level_inter_bytes'] / 1024:>13.0f} "
            f"{r['flat_algorithm']:>8} {r['two_level_algorithm']:>9}")
    return "\n".join(lines)


def format_validation(v) -> str:
    w1 = v["world1"]
    lines = [f"check, case {v['case']}: world 1, model {w1['model_kernels_us']:.1f} µs of "
             f"kernels against {w1['measured_graph_us']:.1f} µs measured for the one-graph "
             f"exchange (x{w1['model_over_measured']:.2f})",
             f"check, case {v['case']}: ranks sharing one H200 (model: every rank's kernels "
             f"one after the other), world: model / measured fused / measured alone µs"]
    for s in v["shared_gpu"]:
        lines.append(f"  world {s['world']}: {s['model_serialized_us']:.1f} / "
                     f"{s['measured_fused_us']:.1f} / {s['measured_alone_us']:.1f} "
                     f"(x{s['model_over_measured']:.2f})")
    return "\n".join(lines)


def plot(path, case, platforms, algorithm, host_step_us) -> bool:
    """Write a PNG of µs per exchange against world at full nodes. False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in platforms:
        p = PLATFORMS[name]
        pts = [(w, n) for w, n in grid(p) if w // n == p.ranks_per_node]
        worlds = [w for w, _ in pts]
        fl = [flat_us(w, n, p, case, algorithm, host_step_us) for w, n in pts]
        tl = [two_level_us(w, n, p, case, algorithm, host_step_us) for w, n in pts]
        line, = ax.plot(worlds, fl, "o--", label=f"{name} flat")
        ax.plot(worlds, tl, "s-", color=line.get_color(), label=f"{name} two-level")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world (ranks; 8 per node)")
    ax.set_ylabel("modelled µs per exchange")
    ax.set_title(f"Case {case}: flat against two-level (model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="b", help="benchmark case: b or e (default b)")
    ap.add_argument("--platform", default="all",
                    help="one of " + ", ".join(PLATFORMS) + ", or all (default)")
    ap.add_argument("--algorithm", default="best",
                    help="MPI all-gather: rd, ring, or best of the two (default)")
    ap.add_argument("--host-step-us", type=float, default=None,
                    help="µs of one return to the host around the MPI step "
                         "(default: the case's measured value)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    case = _case(args.case)
    algorithm = _algorithm(args.algorithm)
    if args.platform == "all":
        names = list(PLATFORMS)
    else:
        names = [_platform(args.platform).name]
    if args.host_step_us is not None and args.host_step_us < 0:
        raise ValueError(f"host_step_us must be >= 0, got {args.host_step_us!r}")

    out = {"case": case.name, "algorithm": algorithm, "constants": constants(),
           "tables": {}, "summaries": {}, "validation": validation(case)}
    print(f"Modelled µs per exchange, case {case.name} ({case.context} context, heads "
          f"{case.heads}, rows {case.rows}, topk {case.topk}; {case.payload_bytes // 1024} KiB "
          f"packed per rank); MPI all-gather: {algorithm}")
    for name in names:
        rows = table(name, case, algorithm, args.host_step_us)
        out["tables"][name] = rows
        print(f"\n{name}: {PLATFORMS[name].description}")
        print(format_table(rows))
    print()
    print(format_validation(out["validation"]))
    print()
    for name in PLATFORMS:  # one line per platform, whatever --platform shows
        s = summary(name, case, algorithm, args.host_step_us)
        out["summaries"][name] = s
        print(s["text"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        if plot(args.plot, case.name, names, algorithm, args.host_step_us):
            print(f"wrote {args.plot}")
        else:
            print("--plot: matplotlib is not installed; no plot written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
