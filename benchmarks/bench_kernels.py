"""Kernel benchmark on one GPU: device time (CUDA-graph replay), eager time, PyTorch baseline.

    NUMBA_CP_BACKEND=cuda python benchmarks/bench_kernels.py --json bench.json [--cases a,b]

For each benchmark case (heads 4 unless stated; seq_lens uniform in
[context/2, context] with the first request at context; standard-normal scores;
init_blocks 1, local_blocks 2):

* ``pack``: ``local_topk_keys`` on rank 0's shard; ``merge``: ``merge_topk_keys`` on
  the gathered keys of all ranks (case g: heads 1, with the sparse block table).
* ``device us``: N calls captured in one CUDA graph on a CuPy stream and replayed;
  time per call, so launch cost is excluded.
* ``eager us``: Python call -> work queued, CuPy arrays in, over ``--calls`` calls and
  one synchronisation, the best of rounds spread over the whole run (one after each
  case, ``--rounds`` more at the end, a second apart); ``torch in``: the same calls
  with PyTorch tensors over the same memory, on PyTorch's current stream. A second
  table adds ``host us``: the same rounds up to the last call's return, the host's cost
  alone where the kernel takes longer than the call.
* ``world1``: ``global_topk_ids``, the exchange at world 1 in one kernel, on the whole
  unsharded row.
* ``torch``: the same exchange written in plain PyTorch (int64 key packing +
  ``torch.topk``), graph-replayed and eager, plus ``torch.topk`` over the full
  unsharded forced rows (float scores, no sharding) as the single-GPU reference.

Every result is verified against numba_cp.reference in the same run. Prints a
table and writes JSON. Speed is only ever measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


import numba_cp
from numba_cp import reference as ref
from numba_cp.arrays import host_copy
from numba_cp.ops import global_topk_ids
from numba_cp.constants import INIT_SCORE, LOCAL_SCORE, PAGES
from numba_cp.kernels.keys import ORDERED_INIT, ORDERED_LOCAL
from numba_cp.workload import decode_workload

K = 1024
CASES = {  # context, world, topk, batch, query_len, heads, sparse table
    "a": (32 * K, 4, 16, 64, 1, 4, False),
    "b": (128 * K, 4, 16, 64, 1, 4, False),
    "c": (128 * K, 4, 32, 64, 4, 4, False),
    "d": (512 * K, 8, 64, 64, 1, 4, False),
    "e": (1024 * K, 4, 128, 32, 1, 4, False),
    "f": (128 * K, 8, 16, 256, 1, 4, False),
    "g": (128 * K, 4, 32, 64, 1, 1, True),
}
INIT_BLOCKS, LOCAL_BLOCKS = 1, 2
# The reference Triton exchange kernels (the ROCm stack this package is compared
# with), device µs per call on one H200 with Triton 3.6, CUDA-graph replay, on
# these cases' inputs, 2026-12-03: pack, merge, and world 1 as one graph of
# pack + merge. Their outputs were bit-identical to ours. None where not measured.
REFERENCE_US = {
    "a": (2.22, 2.12, 5.72),
    "b": (2.74, 2.09, 9.56),
    "c": (6.78, 5.83, None),
    "d": (5.05, 5.07, None),
    "e": (17.44, 3.84, 74.0),
    "f": (5.28, 5.19, None),
    "g": (2.39, 2.42, 8.88),
}


def case_arrays(name, seed=0):
    """bench_kernels.py's case ``name``: its workload, window, shard arguments and
    CuPy arrays (every rank's shard and keys, the outputs zeroed)."""
    import cupy

    context, world, topk, batch, query_len, heads, table, *_ = CASES[name]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context,
                           seed=seed)
    window = dict(query_len=query_len, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS)
    shard_args = dict(window, world=world, global_blocks=work.global_blocks)
    shards = [cupy.asarray(ref.shard_scores(work.full_scores, rank=r, world=world,
                                            global_blocks=work.global_blocks))
              for r in range(world)]
    seq = cupy.asarray(work.seq_lens)
    keys = cupy.zeros((world, heads, work.tokens, topk), cupy.int64)
    for r in range(world):
        numba_cp.local_topk_keys(shards[r], seq, topk=topk, rank=r, out=keys[r], **shard_args)
    arrays = dict(scores=shards[0], seq_lens=seq, keys=keys,
                  out=cupy.zeros((heads, work.tokens, topk), cupy.int64),
                  topk_idx=cupy.zeros((heads, work.tokens, topk), cupy.int32))
    if table:
        arrays.update(
            attention_block_table=cupy.asarray(np.random.default_rng(seed + 1).integers(
                0, 1 << 20, size=(batch, work.global_blocks), dtype=np.int32)),
            sparse_block_table_out=cupy.zeros((work.tokens, topk * PAGES), cupy.int32),
            sparse_context_lens_out=cupy.zeros((work.tokens,), cupy.int32))
    return topk, window, shard_args, arrays


def device_us(call, stream, per_graph, replays):
    """Per-call device time of ``call(stream)``: a graph of ``per_graph`` calls, replayed."""
    import cupy

    call(stream)  # compile and warm outside the capture
    stream.synchronize()
    stream.begin_capture()
    for _ in range(per_graph):
        call(stream)
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(replays):
        graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / (per_graph * replays)


_FLOOR = []


def floor_kernel():
    """A probe with the pack's grid and one warp per row that only loads and stores.

    It reads the row's seq_len and 32 scores and writes 32 keys: the cost of a
    launch plus one dependent-free memory round trip, which no pack can beat.
    """
    if not _FLOOR:
        from numba import cuda

        @cuda.jit(device=True, inline=True)
        def read_row_write_row(scores, seq_lens, out):
            row = cuda.blockIdx.x
            head = cuda.blockIdx.y
            lane = cuda.threadIdx.x
            n = seq_lens[row]
            if lane < scores.shape[2] and lane < out.shape[2]:
                out[head, row, lane] = int(scores[head, row, lane] > 0) + n

        @cuda.jit
        def floor(scores, seq_lens, out):
            read_row_write_row(scores, seq_lens, out)

        _FLOOR.extend((floor, read_row_write_row))
    return _FLOOR[0]


def floor_row():
    """The floor probe's work as an inlined device function, for probes that
    wrap it in kernels of other signatures."""
    floor_kernel()
    return _FLOOR[1]


EAGER_ROUNDS = 3


class EagerRounds:
    """Eager µs per call: ``calls`` back-to-back calls and one synchronisation, the
    best of rounds spread over the whole run, read as timeit reads a host cost.

    Each round gives two figures. ``key`` is the whole round per call, synchronisation
    included: the host's cost where the host is the slower side, the kernel's where the
    GPU is. ``host_key(key)`` is the time until the last call returned, per call: the
    host's cost alone, for no call waits on the GPU while the round's launches (a few
    hundred) fit in the stream's launch queue.

    One host's eager figures moved by up to 6 µs between stretches of a few seconds of
    one process while device figures repeated to 0.01 µs (results/h100-2026-12-07/,
    eager_variants_0d8a4c6.txt): rounds back to back all fall in one stretch, so each
    call's rounds are taken seconds apart instead. ``add`` registers a call (after one
    untimed call); ``run_round`` times one round of every call registered so far that
    has had fewer than ``fewer_than`` rounds; ``finish`` gives every call the same
    number, so that a case registered late is not judged on fewer rounds than the first.
    """

    def __init__(self, calls):
        self.calls = calls
        self.entries = []  # [row, key, call(stream), stream: has synchronize(), rounds]

    def add(self, row, key, call, stream):
        host_key(key)  # refuses a key that names no eager call
        call(stream)
        stream.synchronize()
        self.entries.append([row, key, call, stream, 0])

    def run_round(self, fewer_than=None):
        for entry in self.entries:
            row, key, call, stream, rounds = entry
            if fewer_than is not None and rounds >= fewer_than:
                continue
            start = time.perf_counter()
            for _ in range(self.calls):
                call(stream)
            queued = time.perf_counter()
            stream.synchronize()
            done = time.perf_counter()
            for name, took in ((key, done - start), (host_key(key), queued - start)):
                row[name] = min(row.get(name, float("inf")), took * 1e6 / self.calls)
            entry[4] = rounds + 1

    def finish(self, more, pause_s=1.0):
        """``more`` rounds past the most any call has had, ``pause_s`` apart, the
        calls behind first catching up."""
        target = max((entry[4] for entry in self.entries), default=0) + more
        while any(entry[4] < target for entry in self.entries):
            time.sleep(pause_s)
            self.run_round(fewer_than=target)


def host_key(key):
    """The row key of an eager call's host figure: ``pack_eager_us`` -> ``pack_host_us``."""
    if "_eager_" not in key:
        raise ValueError(f"an eager call's key names it eager, got {key!r}")
    return key.replace("_eager_", "_host_", 1)


class TorchExchange:
    """The exchange in plain PyTorch: a baseline, exact because keys are unique."""

    def __init__(self, torch, work, world, topk, rank=0):
        self.t = torch
        dev = "cuda"
        self.world, self.topk, self.rank = world, topk, rank
        self.ql = work.query_len
        self.gb = work.global_blocks
        tokens = work.tokens
        self.request = torch.arange(tokens, device=dev) // self.ql
        self.t_in_req = torch.arange(tokens, device=dev) % self.ql
        # constants made before any graph capture (a host->device copy can't be captured)
        self.init_score = torch.tensor(float(INIT_SCORE), device=dev)
        self.local_score = torch.tensor(float(LOCAL_SCORE), device=dev)
        self.minus_inf = torch.tensor(float("-inf"), device=dev)

    def window(self, seq_lens):
        t = self.t
        causal = seq_lens.long()[self.request] - self.ql + self.t_in_req + 1
        valid = t.clamp((causal + 127) // 128, min=0)
        return valid, t.clamp(valid - LOCAL_BLOCKS, min=0)

    def ordered(self, bits):
        t = self.t
        bits = t.where(bits == 0x80000000, t.zeros_like(bits), bits)
        ordered = t.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
        return t.where((bits & 0x7FFFFFFF) > 0x7F800000, t.zeros_like(ordered), ordered)

    def pack(self, scores, seq_lens):
        t = self.t
        local = scores.shape[2]
        g = t.arange(local, device=scores.device) * self.world + self.rank
        valid, local_start = self.window(seq_lens)
        s = t.where(g < INIT_BLOCKS, self.init_score, scores)
        s = t.where(g[None, :] >= local_start[:, None], self.local_score, s)
        bits = s.view(t.int32).long() & 0xFFFFFFFF
        key = (1 << 48) | (self.ordered(bits) << 16) | (g + 1)
        ok = (g[None, :] < valid[:, None]) & (g < self.gb)
        key = t.where(ok, key, t.zeros_like(key))
        return t.topk(key, min(self.topk, local), dim=-1).values

    def merge(self, keys, seq_lens):
        t = self.t
        w, h, tokens, k = keys.shape
        flat = keys.permute(1, 2, 0, 3).reshape(h, tokens, w * k)
        valid, local_start = self.window(seq_lens)
        block = (flat & 0xFFFF) - 1
        ordered = (flat >> 16) & 0xFFFFFFFF
        bits = t.where((ordered & 0x80000000) != 0, ordered ^ 0x80000000, ordered ^ 0xFFFFFFFF)
        ordered = self.ordered(bits)
        ordered = t.where(block < INIT_BLOCKS, t.full_like(ordered, ORDERED_INIT), ordered)
        ordered = t.where(block >= local_start[:, None], t.full_like(ordered, ORDERED_LOCAL),
                          ordered)
        rekey = t.where(flat != 0, (1 << 48) | (ordered << 16) | (block + 1),
                        t.zeros_like(flat))
        top = t.topk(rekey, self.topk, dim=-1).values
        j = t.arange(self.topk, device=flat.device)
        keep = (top != 0) & (j[None, None, :] < t.clamp(valid, max=self.topk)[None, :, None])
        return t.where(keep, (top & 0xFFFF) - 1, t.full_like(top, -1)).int()

    def full_topk(self, full, seq_lens):
        """torch.topk over the unsharded forced rows (float scores)."""
        t = self.t
        g = t.arange(full.shape[2], device=full.device)
        valid, local_start = self.window(seq_lens)
        s = t.where(g < INIT_BLOCKS, self.init_score, full)
        s = t.where(g[None, :] >= local_start[:, None], self.local_score, s)
        s = t.where(g[None, :] < valid[:, None], s, self.minus_inf)
        return t.topk(s, self.topk, dim=-1).indices


def torch_times(torch, fn, per_graph, replays, calls):
    """(device us via torch.cuda.graph replay, eager us) of ``fn()``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    device = start.elapsed_time(stop) * 1e3 / (per_graph * replays)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return device, (time.perf_counter() - t0) * 1e6 / calls


def run_case(name, args, torch, eager):
    """Case ``name``'s row, its eager calls registered with ``eager``, and ``finish()``:
    the check of every output against the oracle and the PyTorch baseline, to run after
    the last eager round (the eager calls rewrite the outputs it checks)."""
    import cupy

    context, world, topk, batch, query_len, heads, table_on = CASES[name]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context,
                           seed=args.seed)
    window = dict(query_len=query_len, init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS)
    shard_args = dict(window, world=world, global_blocks=work.global_blocks)
    tokens = work.tokens
    shards = [cupy.asarray(ref.shard_scores(work.full_scores, rank=r, world=world,
                                            global_blocks=work.global_blocks))
              for r in range(world)]
    seq_lens = cupy.asarray(work.seq_lens)
    gathered = cupy.zeros((world, heads, tokens, topk), cupy.int64)
    for r in range(world):
        numba_cp.local_topk_keys(shards[r], seq_lens, topk=topk, rank=r, out=gathered[r],
                                 **shard_args)
    out = gathered[0].copy()
    topk_idx = cupy.zeros((heads, tokens, topk), cupy.int32)
    tables = {}
    host_table = None
    if table_on:
        host_table = np.random.default_rng(args.seed + 1).integers(
            0, 1 << 20, size=(batch, work.global_blocks), dtype=np.int32)
        tables = dict(attention_block_table=cupy.asarray(host_table),
                      sparse_block_table_out=cupy.zeros((tokens, topk * PAGES), cupy.int32),
                      sparse_context_lens_out=cupy.zeros((tokens,), cupy.int32))

    launch = dict(method=args.method)

    def pack(stream):
        numba_cp.local_topk_keys(shards[0], seq_lens, topk=topk, rank=0, out=out,
                                 stream=stream, **shard_args, **launch)

    def merge(stream):
        numba_cp.merge_topk_keys(gathered, topk_idx, seq_lens, stream=stream, **window,
                                 **tables, **launch)

    world1_idx = cupy.zeros_like(topk_idx)
    world1_tables = {k: cupy.zeros_like(v) if k.endswith("_out") else v
                     for k, v in tables.items()}
    full_scores = cupy.asarray(work.full_scores)

    def world1(stream):
        global_topk_ids(full_scores, seq_lens, world1_idx, stream=stream,
                        global_blocks=work.global_blocks, **window, **world1_tables, **launch)

    stream = cupy.cuda.Stream(non_blocking=True)
    row = dict(case=name, context=context, world=world, topk=topk, batch=batch,
               query_len=query_len, heads=heads, sparse_table=table_on)
    if args.sweep_launch:
        # device time per launch shape; results never depend on it
        sweep = []
        # one knob at a time around the defaults (each new shape is a compile)
        shapes = [("warp", None, n) for n in (32, 64, 128, 256)]
        shapes += [("warp", t, n) for t in (32, 256, 512, 1024) for n in (32, 64)]
        shapes += [("rank", None, n) for n in (None, 32, 128)]
        shapes += [("rank", t, None) for t in (64, 128)]
        shapes += [("radix", None, None)]
        with stream:
            for method, threads, sort_limit in shapes:
                launch.update(method=method, threads=threads, sort_limit=sort_limit)
                entry = dict(method=method, threads=threads, sort_limit=sort_limit)
                # world 1 ranks the whole row (a shard's rows times world), so a shape
                # may fit the pack and not world 1
                stages = dict(merge=merge, world1=world1)
                if not table_on:
                    stages = dict(pack=pack, **stages)
                for stage, call in stages.items():
                    try:
                        entry[f"{stage}_device_us"] = device_us(call, stream, 20, 5)
                    except ValueError as exc:  # a shape this case's topk or rows rule out
                        entry[f"{stage}_skipped"] = str(exc)
                sweep.append(entry)
        row["launch_sweep"] = sweep
        launch.clear()
        launch.update(method=args.method)
    with stream:
        if not table_on:
            row["pack_device_us"] = device_us(pack, stream, args.per_graph, args.replays)
            eager.add(row, "pack_eager_us", pack, stream)
        row["merge_device_us"] = device_us(merge, stream, args.per_graph, args.replays)
        eager.add(row, "merge_eager_us", merge, stream)
        row["world1_device_us"] = device_us(world1, stream, args.per_graph, args.replays)
        eager.add(row, "world1_eager_us", world1, stream)
        if not table_on:
            from numba import cuda as numba_cuda

            probe = floor_kernel()
            probe_stream = numba_cuda.external_stream(stream.ptr)
            grid = (tokens, heads)
            probe_out = cupy.zeros_like(out)  # not `out`: that one is verified below

            def floor(stream):
                probe[grid, 32, probe_stream](shards[0], seq_lens, probe_out)

            row["floor_device_us"] = device_us(floor, stream, args.per_graph, args.replays)
        stream.synchronize()
    if torch is not None:
        # The same calls with PyTorch tensors over the same memory and no stream (so on
        # PyTorch's current stream): what a PyTorch caller pays. They rewrite the
        # outputs verified below.
        t = {name: torch.as_tensor(v, device="cuda") for name, v in
             dict(shard=shards[0], seq_lens=seq_lens, out=out, keys=gathered, idx=topk_idx,
                  scores=full_scores, world1_idx=world1_idx).items()}
        t_tables = {k: torch.as_tensor(v, device="cuda") for k, v in tables.items()}
        t_world1 = {k: torch.as_tensor(v, device="cuda") for k, v in world1_tables.items()}
        tensor_calls = {
            "merge": lambda: numba_cp.merge_topk_keys(t["keys"], t["idx"], t["seq_lens"],
                                                      **window, **t_tables, **launch),
            "world1": lambda: global_topk_ids(t["scores"], t["seq_lens"], t["world1_idx"],
                                              global_blocks=work.global_blocks, **window,
                                              **t_world1, **launch)}
        if not table_on:
            tensor_calls["pack"] = lambda: numba_cp.local_topk_keys(
                t["shard"], t["seq_lens"], topk=topk, rank=0, out=t["out"], **shard_args,
                **launch)
        for stage, call in tensor_calls.items():
            # torch.cuda.synchronize() waits for PyTorch's stream as a stream's would
            eager.add(row, f"{stage}_eager_torch_us", lambda _, call=call: call(), torch.cuda)

    def finish():
        """Check the case's outputs against the oracle; add the PyTorch baseline."""
        # verify what the timed calls produced
        shard0 = ref.shard_scores(work.full_scores, rank=0, world=world,
                                  global_blocks=work.global_blocks)
        want_keys = ref.local_topk_keys(shard0, work.seq_lens, topk=topk, rank=0, **shard_args)
        unsharded = ref.global_topk(work.full_scores, work.seq_lens, topk=topk,
                                    global_blocks=work.global_blocks, **window)
        exact = bool(np.array_equal(host_copy(out), want_keys)) and bool(
            np.array_equal(host_copy(topk_idx), unsharded))
        exact &= bool(np.array_equal(host_copy(world1_idx), unsharded))
        if table_on:
            want_sbt, want_ctx = ref.sparse_block_table(unsharded, work.seq_lens, host_table,
                                                        query_len=query_len)
            for got in (tables, world1_tables):
                exact &= bool(np.array_equal(host_copy(got["sparse_block_table_out"]),
                                             want_sbt[0]))
                exact &= bool(np.array_equal(host_copy(got["sparse_context_lens_out"]),
                                             want_ctx[0]))
        row["exact"] = exact
        reference = REFERENCE_US.get(name, (None, None, None))
        row.update(reference_pack_us=reference[0], reference_merge_us=reference[1],
                   reference_world1_us=reference[2])
        for stage, ours in (("pack", row.get("pack_device_us")),
                            ("merge", row["merge_device_us"]),
                            ("world1", row["world1_device_us"])):
            theirs = row[f"reference_{stage}_us"]
            row[f"{stage}_vs_reference"] = (None if (ours is None or theirs is None)
                                            else ours / theirs)

        if torch is not None:
            tx = TorchExchange(torch, work, world, topk)
            t_shard = torch.as_tensor(shards[0], device="cuda")
            t_seq = torch.as_tensor(seq_lens, device="cuda")
            t_keys = torch.as_tensor(gathered, device="cuda")
            t_full = torch.as_tensor(cupy.asarray(work.full_scores), device="cuda")
            row["torch_pack_device_us"], row["torch_pack_eager_us"] = torch_times(
                torch, lambda: tx.pack(t_shard, t_seq), args.per_graph, args.replays, args.calls)
            row["torch_merge_device_us"], row["torch_merge_eager_us"] = torch_times(
                torch, lambda: tx.merge(t_keys, t_seq), args.per_graph, args.replays, args.calls)
            row["torch_full_topk_device_us"], row["torch_full_topk_eager_us"] = torch_times(
                torch, lambda: tx.full_topk(t_full, t_seq), args.per_graph, args.replays,
                args.calls)
            row["torch_exact"] = bool(
                np.array_equal(tx.pack(t_shard, t_seq).cpu().numpy()[..., :topk], want_keys)
                and np.array_equal(tx.merge(t_keys, t_seq).cpu().numpy(), unsharded))

    return row, finish


def exchange_replay(args):
    """Case b through CandidateExchange at world 1, captured once, replayed (device us)."""
    import cupy
    from mpi4py import MPI

    from numba_cp.exchange import CandidateExchange, ExchangeConfig

    context, _, topk, batch, query_len, heads, *_ = CASES["b"]
    work = decode_workload(heads=heads, batch=batch, query_len=query_len, context=context,
                           seed=args.seed)
    config = ExchangeConfig(heads=heads, max_tokens=work.tokens, topk=topk, world=1,
                            global_blocks=work.global_blocks, init_blocks=INIT_BLOCKS,
                            local_blocks=LOCAL_BLOCKS, query_len=query_len)
    scores = cupy.asarray(work.full_scores)
    seq_lens = cupy.asarray(work.seq_lens)
    stream = cupy.cuda.Stream(non_blocking=True)
    with CandidateExchange(MPI.COMM_SELF, config) as plan:
        captured = plan.capture(scores, seq_lens, stream=stream)
        captured.replay()
        stream.synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(args.replays * 10):
            captured.replay()
        stop.record(stream)
        stop.synchronize()
        per_replay = cupy.cuda.get_elapsed_time(start, stop) * 1e3 / (args.replays * 10)
        got = host_copy(captured.outputs)
    want = ref.global_topk(work.full_scores, work.seq_lens, topk=topk,
                           global_blocks=work.global_blocks, query_len=query_len,
                           init_blocks=INIT_BLOCKS, local_blocks=LOCAL_BLOCKS)
    return dict(case="b", world=1, replay_device_us=per_replay,
                exact=bool(np.array_equal(got, want)))


def fmt(value):
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def print_table(cols, rows):
    widths = [max(11, len(header)) for header, _ in cols]
    print("  ".join(f"{h:>{w}}" for (h, _), w in zip(cols, widths)))
    for row in rows:
        cells = []
        for (_, key), w in zip(cols, widths):
            v = row.get(key)
            cells.append(f"{v!s:>{w}}" if isinstance(v, (str, bool)) else f"{fmt(v):>{w}}")
        print("  ".join(cells))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--per-graph", type=int, default=50, help="calls captured per graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays timed")
    p.add_argument("--calls", type=int, default=200, help="eager calls timed in a round")
    p.add_argument("--rounds", type=int, default=EAGER_ROUNDS,
                   help="eager rounds at the end, a second apart (one more after each case, "
                        "and every call gets as many as the first); the best is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torch", action="store_true",
                   help="skip the PyTorch baseline and the calls with tensors")
    p.add_argument("--exchange", action="store_true",
                   help="also time case b's whole exchange at world 1 as a captured graph")
    p.add_argument("--sweep-launch", action="store_true",
                   help="also time every threads x sort_limit launch shape per case "
                        "(pack, merge and world 1)")
    p.add_argument("--method", choices=numba_cp.METHODS, default="auto",
                   help="kernel family timed (the sweep tries each)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("calls", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if numba_cp.backend.TARGET.simulator:
        raise SystemExit("bench_kernels.py times a GPU: run it with NUMBA_CP_BACKEND=cuda "
                         "(or hip) on a GPU node")
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("PyTorch not installed: no baseline", file=sys.stderr)
    rows, finishes = [], []
    eager = EagerRounds(args.calls)
    for name in args.cases.split(","):
        row, finish = run_case(name.strip(), args, torch, eager)
        rows.append(row)
        finishes.append(finish)
        eager.run_round()
        print(f"case {name} done", file=sys.stderr, flush=True)
    eager.finish(args.rounds)
    for finish in finishes:
        finish()
    cols = [("case", "case"), ("pack dev", "pack_device_us"), ("/ref", "pack_vs_reference"),
            ("pack eager", "pack_eager_us"), ("torch in", "pack_eager_torch_us"),
            ("merge dev", "merge_device_us"), ("/ref", "merge_vs_reference"),
            ("merge eager", "merge_eager_us"), ("torch in", "merge_eager_torch_us"),
            ("world1 dev", "world1_device_us"), ("/ref", "world1_vs_reference"),
            ("world1 eager", "world1_eager_us"), ("torch in", "world1_eager_torch_us"),
            ("torch pack", "torch_pack_device_us"), ("torch merge", "torch_merge_device_us"),
            ("torch full", "torch_full_topk_device_us"), ("floor", "floor_device_us"),
            ("exact", "exact")]
    print(f"backend {numba_cp.backend.describe()}; times in us per call; dev = CUDA-graph "
          "replay, eager = Python call to queued work with CuPy arrays, torch in = the same "
          "with PyTorch tensors")
    print_table(cols, rows)
    host_cols = [("case", "case")] + [
        (f"{stage} {label}", f"{stage}_{kind}_{caller}us")
        for stage in ("pack", "merge", "world1")
        for kind, caller, label in (("eager", "", "eager"), ("host", "", "host"),
                                    ("eager", "torch_", "torch"), ("host", "torch_", "t host"))]
    print("\neager calls: eager = a round of calls and its synchronisation, host = until the "
          "last call returned (the host's cost alone), per call; torch = PyTorch tensors in")
    print_table(host_cols, rows)
    for row in rows:
        for stage in ("pack", "merge", "world1"):
            timed = [e for e in row.get("launch_sweep", []) if f"{stage}_device_us" in e]
            if timed:
                best = min(timed, key=lambda e: e[f"{stage}_device_us"])
                print(f"case {row['case']} {stage}: best {best[f'{stage}_device_us']:.1f} us "
                      f"at method={best['method']} threads={best['threads']} "
                      f"sort_limit={best['sort_limit']}")
    replay = exchange_replay(args) if args.exchange else None
    if replay:
        print(f"exchange world 1, case b, captured graph replay: "
              f"{replay['replay_device_us']:.1f} us per exchange, "
              f"exact={replay['exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=numba_cp.backend.describe(), date=time.strftime("%Y-%m-%d"),
                           argv=sys.argv[1:], rows=rows, exchange_replay=replay), f, indent=2)
    exact = all(r["exact"] for r in rows) and (replay is None or replay["exact"])
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
