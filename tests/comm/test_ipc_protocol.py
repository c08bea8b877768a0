"""The IPC all-gather's protocol: a model of it, then its kernels on simulated ranks.

- a pure-Python model of the protocol, driven through many random
  interleavings at the granularity of single slot writes, flag stores and
  slot reads, with the halves addressed by the kernels' own ``slot_base``;
  the same model without double buffering, or waiting for ``flag == epoch``,
  must fail (so the model can see the races the design avoids);
- the real IPC kernels under the simulator with several ranks in one
  process, stepped kernel by kernel: a rank running a call ahead, timeouts
  and poison, more peers than one push launch serves, the byte-wise path,
  and payloads smaller than the buffers were laid out for.

The expected gather is always every rank's payload, computed independently.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from numba_cp import ops
from numba_cp import reference as ref
from numba_cp.backend import TARGET, cuda
from numba_cp.comm import ipc as I
from numba_cp.kernels import ipc as K

sim_only = pytest.mark.skipif(not TARGET.simulator,
                              reason="drives simulated ranks in one process")


# ---------------------------------------------------------------------------
# The protocol as a model


ROWS = 3  # a payload's rows: they land and are read one by one


def run_model(world, calls, rng, *, double_buffer=True, wait_ge=True, fused=False):
    """One random interleaving of ``world`` ranks making ``calls`` all-gathers.

    Per call a rank writes its payload into every peer's slot (one step per
    peer), then stores its flag in every peer (one step each), waits until
    its own flags reach the epoch, then reads every slot (one step each), as
    the kernels do. ``fused``: each call is, at random per rank, the fused
    exchange's order instead -- the pack's blocks deliver row by row into
    every peer in any order, the last one raises the flags, and the merge
    reads every row of every slot in place, to its end -- or the separate
    one. Returns ``(corrupt reads, deadlocked, largest lead)``.
    """
    slot = ((lambda e, q: K.slot_base(e, world, q, 1)) if double_buffer else
            (lambda e, q: q))
    data = [dict() for _ in range(world)]  # owner -> (slot, row) -> (writer, epoch)
    flags = [[0] * world for _ in range(world)]  # owner -> writer -> epoch
    started = [0] * world

    def program(r):
        for e in range(1, calls + 1):
            started[r] = e
            if fused and rng.random() < 0.5:  # the pack's blocks, in any order
                writes = rng.sample([(q, row) for q in range(world) for row in range(ROWS)],
                                    world * ROWS)
            else:  # the push: peer by peer
                writes = [(q, row) for q in rng.sample(range(world), world)
                          for row in range(ROWS)]
            for q, row in writes:
                data[q][slot(e, r), row] = (r, e)
                yield None
            for q in rng.sample(range(world), world):
                flags[q][r] = max(flags[q][r], e)
                yield None
            while not all((f >= e) if wait_ge else (f == e) for f in flags[r]):
                yield "blocked"
            reads = [(q, row) for q in range(world) for row in range(ROWS)]
            for q, row in rng.sample(reads, len(reads)):
                got = data[r].get((slot(e, q), row))
                yield ("read", got == (q, e))

    running = {r: program(r) for r in range(world)}
    blocked = set()  # ranks found waiting since the state last changed
    corrupt, lead = 0, 0
    while running:
        r = rng.choice(sorted(running))
        try:
            step = next(running[r])
        except StopIteration:
            del running[r]
            blocked.discard(r)
            continue
        if step == "blocked":
            blocked.add(r)
            if blocked >= set(running):
                return corrupt, True, lead  # all wait and nobody can change a flag
            continue
        blocked.clear()
        if step is not None and not step[1]:
            corrupt += 1
        lead = max(lead, max(started) - min(started))
    return corrupt, False, lead


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_model_double_buffered_is_exact_and_never_deadlocks(world):
    for seed in range(300 if world < 4 else 120):
        corrupt, deadlocked, lead = run_model(world, 6, random.Random(seed))
        assert (corrupt, deadlocked) == (0, False), f"seed {seed}"
        assert lead <= 1, f"seed {seed}: a rank got {lead} calls ahead"


@pytest.mark.parametrize("world", [2, 3, 5])
def test_model_fused_and_separate_calls_are_exact_and_never_deadlock(world):
    """Fused calls (row-wise delivery, reads in place to the merge's end) mixed at random
    with separate ones on one set of buffers and flags."""
    for seed in range(200 if world < 4 else 80):
        corrupt, deadlocked, lead = run_model(world, 6, random.Random(seed), fused=True)
        assert (corrupt, deadlocked) == (0, False), f"seed {seed}"
        assert lead <= 1, f"seed {seed}: a rank got {lead} calls ahead"


def test_model_sees_the_fused_race_without_double_buffering():
    bad = sum(run_model(2, 6, random.Random(seed), double_buffer=False, fused=True)[0] > 0
              for seed in range(200))
    assert bad > 0


def test_model_sees_the_race_without_double_buffering():
    """One half only: a fast rank's next payload overwrites a slot a peer has not read."""
    bad = sum(run_model(2, 6, random.Random(seed), double_buffer=False)[0] > 0
              for seed in range(200))
    assert bad > 0


def test_model_sees_the_overtaken_flag_when_waiting_for_equality():
    """``flag == epoch``: a peer already at the next call moved the flag on; hangs."""
    hung = sum(run_model(2, 6, random.Random(seed), wait_ge=False)[1] for seed in range(200))
    assert hung > 0


def test_layout():
    L = I.IPCLayout(3, 1000)
    assert L.flag_words == 4 and L.flag_bytes == 256
    assert L.slot_bytes == 1024 and L.data_bytes == 2 * 3 * 1024
    assert L.total_bytes == 256 + 6144
    # call e uses half e & 1; rank q's slot within it
    assert [L.slot_offset(e, 1) for e in (1, 2, 3)] == [4 * 1024, 1024, 4 * 1024]
    assert I.IPCLayout(2, 0).slot_bytes == 256


# ---------------------------------------------------------------------------
# The real kernels, several simulated ranks in one process


class Ranks:
    """``world`` IPCEngines over host shared memory, all in this process.

    The buffers are laid out for payloads of ``shape``; ``shapes[e]`` gives
    call ``e`` a smaller payload (every rank agrees on it, as callers of one
    transport do). :meth:`wait_copy` and :meth:`got` act on the call a rank
    last pushed.
    """

    def __init__(self, world, shape=(2, 3, 4), dtype=np.int64, timeout=30.0, shapes=None):
        self.world, self.shape, self.dtype = world, tuple(shape), np.dtype(dtype)
        self.shapes = dict(shapes or {})
        self.layout = I.IPCLayout(world, self.nbytes(0))
        self.memory = I.HostIPCMemory()
        self.regions = [self.memory.allocate(self.layout.total_bytes) for _ in range(world)]
        self.engines = [I.IPCEngine(r, world, self.layout, self.regions,
                                    self.memory.private_zeros(K.CTRL_WORDS, np.int64),
                                    self.memory.mapped_zeros(K.ERROR_WORDS, np.int64),
                                    timeout=timeout) for r in range(world)]
        self.call = [0] * world
        self._buffers = {}  # (rank, shape) -> (send, recv), kept alive: the views are cached

    def shape_of(self, e):
        return tuple(self.shapes.get(e, self.shape))

    def nbytes(self, e):
        return int(np.prod(self.shape_of(e), dtype=np.int64)) * self.dtype.itemsize

    def unit(self, e):
        return I.IPCEngine.unit_for(self.nbytes(e), 0, 0)

    def buffers(self, r, e):
        shape = self.shape_of(e)
        pair = self._buffers.get((r, shape))
        if pair is None:
            pair = self._buffers[r, shape] = (
                cuda.to_device(np.zeros(shape, self.dtype)),
                cuda.to_device(np.zeros((self.world,) + shape, self.dtype)))
        return pair

    def payload(self, r, e):
        n = int(np.prod(self.shape_of(e), dtype=np.int64))
        raw = (np.arange(n * self.dtype.itemsize, dtype=np.int64) * 7 + 31 * r + 101 * e)
        return (raw % 251).astype(np.uint8).view(self.dtype).reshape(self.shape_of(e))

    def flat(self, r, which, e):
        array = self.buffers(r, e)[0 if which == "send" else 1]
        size = self.nbytes(e) * (1 if which == "send" else self.world)
        return self.engines[r].flat(array, np.asarray(array).ctypes.data, size, self.unit(e))

    def bump(self, r):
        self.engines[r].bump(0)

    def push(self, r, e):
        self.call[r] = e
        np.asarray(self.buffers(r, e)[0])[...] = self.payload(r, e)
        self.engines[r].push(self.flat(r, "send", e), self.nbytes(e), self.unit(e), 0)

    def ready(self, r, e):
        return all(int(f) >= e for f in np.asarray(self.engines[r].own_flags)[:self.world])

    def wait_copy(self, r):
        e = self.call[r]
        self.engines[r].wait_copy(self.flat(r, "recv", e), self.nbytes(e), self.unit(e), 0)

    def expected(self, e):
        return np.stack([self.payload(q, e) for q in range(self.world)])

    def got(self, r):
        return self.buffers(r, self.call[r])[1].copy_to_host()

    def close(self):
        for region in self.regions:
            self.memory.release(region)


@pytest.fixture
def ranks():
    made = []

    def make(*args, **kwargs):
        made.append(Ranks(*args, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


@sim_only
def test_kernels_fast_rank_runs_a_call_ahead(ranks):
    R = ranks(2)
    for r in (0, 1):
        R.bump(r)
        R.push(r, 1)
    R.wait_copy(0)
    assert np.array_equal(R.got(0), R.expected(1))
    R.bump(0)
    R.push(0, 2)  # rank 0 is in call 2; rank 1 has not copied call 1 out yet
    assert not R.ready(0, 2), "rank 0 must wait for rank 1's call 2"
    assert int(np.asarray(R.engines[1].own_flags)[0]) == 2, "rank 0's flag overtook call 1"
    R.wait_copy(1)  # >= 1 passes; call 1's payload is intact in the other half
    assert np.array_equal(R.got(1), R.expected(1))
    R.bump(1)
    R.push(1, 2)
    for r in (0, 1):
        assert R.ready(r, 2)
        R.wait_copy(r)
        assert np.array_equal(R.got(r), R.expected(2))
    assert [e.state()["epoch"] for e in R.engines] == [2, 2]


def run_random_schedule(R, world, calls, rng):
    """Run ``calls`` gathers on every rank, each rank's next kernel chosen at random
    among those that can run, checking each gathered payload and the one-call-ahead
    bound."""
    step = [0] * world  # 0 bump, 1 push, 2 wait_copy (when ready)
    call = [1] * world
    while any(c <= calls for c in call):
        runnable = [r for r in range(world) if call[r] <= calls
                    and (step[r] < 2 or R.ready(r, call[r]))]
        assert runnable, f"stuck at calls {call}, steps {step}"
        r = rng.choice(runnable)
        if step[r] == 0:
            R.bump(r)
        elif step[r] == 1:
            R.push(r, call[r])
        else:
            R.wait_copy(r)
            assert np.array_equal(R.got(r), R.expected(call[r])), (r, call[r])
            call[r] += 1
        step[r] = (step[r] + 1) % 3
        assert max(call) - min(call) <= 2


@sim_only
@pytest.mark.parametrize("world, seed", [(2, 0), (3, 1), (3, 2), (4, 3)])
def test_kernels_random_schedules(ranks, world, seed):
    """Kernel-granularity interleavings: each rank's next kernel runs when it can."""
    R = ranks(world)
    calls = 4
    run_random_schedule(R, world, calls, random.Random(seed))
    for engine in R.engines:
        state = engine.state()
        assert state["epoch"] == calls and state["error_epoch"] == 0


@sim_only
def test_kernels_more_peers_than_one_push_launch(ranks):
    world = K.GROUP + 1  # two push launches per call
    R = ranks(world, shape=(5,), dtype=np.int64)
    for e in (1, 2):
        for r in range(world):
            R.bump(r)
            R.push(r, e)
        for r in range(world):
            assert R.ready(r, e)
            R.wait_copy(r)
            assert np.array_equal(R.got(r), R.expected(e))
    for engine in R.engines:  # two push launches, built by the first call and reused
        (launches,) = engine._separate.values()
        assert [launch.grid[1] for launch, _, _ in launches.pushes] == [K.GROUP, 1]


@sim_only
def test_kernels_byte_payload(ranks):
    R = ranks(3, shape=(3, 7), dtype=np.uint8)  # 21 bytes: the byte-wise kernels
    assert R.unit(1) == 1
    for r in range(3):
        R.bump(r)
        R.push(r, 1)
    for r in range(3):
        R.wait_copy(r)
        assert np.array_equal(R.got(r), R.expected(1))


@sim_only
def test_kernels_timeout_then_poison(ranks):
    R = ranks(3, timeout=0.2)
    R.bump(0)
    R.push(0, 1)
    t0 = time.perf_counter()
    R.wait_copy(0)  # nobody else came: gives up after 0.2 s instead of hanging
    assert 0.2 <= time.perf_counter() - t0 < 10
    state = R.engines[0].state()
    assert (state["error_epoch"], state["error_peer"], state["poisoned_by"]) == (1, 1, -1)
    errors = np.asarray(R.engines[0].errors)  # what the host reads before its next call
    assert (errors[K.GAVE_UP_EPOCH], errors[K.GAVE_UP_PEER], errors[K.POISONED_BY]) == (1, 2, 0)
    # later waits of a rank that gave up do not wait at all, whatever the limit
    R.engines[0].timeout_ns = 10**15
    R.bump(0)
    R.push(0, 2)  # poisons every peer before its payload
    t0 = time.perf_counter()
    R.wait_copy(0)
    assert time.perf_counter() - t0 < 10
    for r in (1, 2):
        assert R.engines[r].state()["poisoned_by"] == 0
    # a poisoned rank stops waiting as well (rank 2 never comes), and records it
    R.engines[1].timeout_ns = 10**15
    R.bump(1)
    R.push(1, 1)
    t0 = time.perf_counter()
    R.wait_copy(1)
    assert time.perf_counter() - t0 < 10
    assert R.engines[1].state()["error_epoch"] == 0
    assert np.asarray(R.engines[1].errors)[K.POISONED_BY] == 1  # 1 + rank 0


@sim_only
@pytest.mark.parametrize("world, seed", [(2, 4), (3, 5)])
def test_kernels_payloads_smaller_than_the_layout(ranks, world, seed):
    """Buffers laid out for 72 bytes; calls of 72, 27, 9 and 72 bytes, in 8-byte words and
    bytes, with ranks drifting a call apart: each call gathers exactly its own payload."""
    shapes = {1: (3, 8, 3), 2: (3, 3, 3), 3: (3, 1, 3), 4: (3, 8, 3), 5: (1, 1, 8)}
    R = ranks(world, shape=(3, 8, 3), dtype=np.uint8, shapes=shapes)
    assert [R.unit(e) for e in shapes] == [8, 1, 1, 8, 8]
    run_random_schedule(R, world, len(shapes), random.Random(seed))
    assert [engine.state()["epoch"] for engine in R.engines] == [len(shapes)] * world


# ---------------------------------------------------------------------------
# The fused exchange's kernels, several simulated ranks in one process


class ExchangeRanks:
    """``world`` ranks exchanging shard keys on shared IPC buffers, each call fused
    (the pack delivers, the merge reads in place) or separate (pack, bump, push,
    wait_copy, merge), chosen per rank and call; checked against the oracle."""

    HEADS, TOKENS, TOPK, BLOCKS = 2, 4, 5, 23
    WINDOW = dict(topk=TOPK, query_len=1, global_blocks=BLOCKS, init_blocks=1, local_blocks=1)

    def __init__(self, world, timeout=30.0, wait_in_merge=True):
        self.world = world
        self.shape = (self.HEADS, self.TOKENS, self.TOPK)
        self.layout = I.IPCLayout(world, int(np.prod(self.shape)) * 8)
        self.memory = I.HostIPCMemory()
        self.regions = [self.memory.allocate(self.layout.total_bytes) for _ in range(world)]
        self.engines = [I.IPCEngine(r, world, self.layout, self.regions,
                                    self.memory.private_zeros(K.CTRL_WORDS, np.int64),
                                    self.memory.mapped_zeros(K.ERROR_WORDS, np.int64),
                                    timeout=timeout, wait_in_merge=wait_in_merge)
                        for r in range(world)]
        self.send = [np.zeros(self.shape, np.int64) for _ in range(world)]
        self.recv = [np.zeros((world,) + self.shape, np.int64) for _ in range(world)]
        self.idx = [np.zeros((self.HEADS, self.TOKENS, self.TOPK), np.int32)
                    for _ in range(world)]

    def workload(self, e):
        rng = np.random.default_rng(e)
        scores = rng.standard_normal((self.HEADS, self.TOKENS, self.BLOCKS)).astype(np.float32)
        scores[:, :, rng.integers(0, self.BLOCKS, 3)] = 0.25  # ties across shards
        seq_lens = rng.integers(1, (self.BLOCKS + 2) * 128, self.TOKENS).astype(np.int32)
        return scores, seq_lens

    def pack(self, r, e, fused):
        scores, seq_lens = self.workload(e)
        shard = ref.shard_scores(scores, rank=r, world=self.world, global_blocks=self.BLOCKS)
        window = dict(self.WINDOW, rank=r, world=self.world)
        if fused:
            d = self.engines[r].delivery()
            ops.local_topk_keys_to_peers(shard, seq_lens, ctrl=d.ctrl, peers=d.peers,
                                         data_start=d.data_start, slot=d.slot, **window)
            return
        ops.local_topk_keys(shard, seq_lens, out=self.send[r], **window)
        engine, nbytes = self.engines[r], self.send[r].nbytes
        engine.bump(0)
        engine.push(engine.flat(self.send[r], self.send[r].ctypes.data, nbytes, 8), nbytes, 8, 0)

    def ready(self, r, e):
        return all(int(f) >= e for f in np.asarray(self.engines[r].own_flags)[:self.world])

    def merge(self, r, e, fused):
        _, seq_lens = self.workload(e)
        window = {k: v for k, v in self.WINDOW.items() if k not in ("topk", "global_blocks")}
        if fused:
            d = self.engines[r].delivery()
            if not d.wait_in_merge:
                d.wait(0)
            ops.merge_delivered_keys(d.keys_view(self.shape, slice(None)), self.idx[r], seq_lens,
                                     ctrl=d.ctrl, flags=d.flags, errors=d.errors,
                                     timeout_ns=d.timeout_ns, block_wait=d.wait_in_merge,
                                     **window)
        else:
            engine, nbytes = self.engines[r], self.send[r].nbytes
            engine.wait_copy(engine.flat(self.recv[r], self.recv[r].ctypes.data,
                                         self.world * nbytes, 8), nbytes, 8, 0)
            ops.merge_topk_keys(self.recv[r], self.idx[r], seq_lens, **window)
        return self.idx[r].copy()

    def expected(self, e):
        scores, seq_lens = self.workload(e)
        return ref.global_topk(scores, seq_lens, **self.WINDOW)

    def close(self):
        for region in self.regions:
            self.memory.release(region)


@sim_only
@pytest.mark.parametrize("world, seed, wait_in_merge", [(2, 0, True), (3, 1, False),
                                                        (4, 2, True), (4, 3, False)])
def test_fused_and_separate_calls_interleave_exactly(world, seed, wait_in_merge):
    """Kernel-granularity interleavings of fused and separate calls, a rank up to a call
    ahead, the fused merge waiting in its blocks or after a wait kernel: every merge
    equals the oracle, and the epochs end equal."""
    rng = random.Random(seed)
    R = ExchangeRanks(world, wait_in_merge=wait_in_merge)
    calls = 5
    try:
        step, call = [0] * world, [1] * world
        fused = [[rng.random() < 0.6 for _ in range(calls + 1)] for _ in range(world)]
        while any(c <= calls for c in call):
            runnable = [r for r in range(world) if call[r] <= calls
                        and (step[r] == 0 or R.ready(r, call[r]))]
            assert runnable, f"stuck at calls {call}, steps {step}"
            r = rng.choice(runnable)
            e = call[r]
            if step[r] == 0:
                R.pack(r, e, fused[r][e])
            else:
                assert np.array_equal(R.merge(r, e, fused[r][e]), R.expected(e)), (r, e)
                call[r] += 1
            step[r] ^= 1
            assert max(call) - min(call) <= 2
        assert any(any(f[1:]) for f in fused) and not all(all(f[1:]) for f in fused)
        for engine in R.engines:
            state = engine.state()
            assert state["epoch"] == calls and state["error_epoch"] == 0
    finally:
        R.close()


@sim_only
@pytest.mark.parametrize("wait_in_merge", [True, False])
def test_fused_merge_gives_up_then_the_next_pack_poisons(wait_in_merge):
    R = ExchangeRanks(3, timeout=0.2, wait_in_merge=wait_in_merge)
    try:
        R.pack(0, 1, fused=True)
        t0 = time.perf_counter()
        R.merge(0, 1, fused=True)  # nobody else came: gives up instead of hanging
        assert 0.2 <= time.perf_counter() - t0 < 10
        errors = np.asarray(R.engines[0].errors)
        assert (errors[K.GAVE_UP_EPOCH], errors[K.GAVE_UP_PEER]) == (1, 2)
        R.pack(0, 2, fused=True)  # poisons every peer before its keys
        for r in (1, 2):
            assert R.engines[r].state()["poisoned_by"] == 0
        R.engines[1].timeout_ns = 10**15  # a poisoned merge stops waiting, whatever the limit
        R.pack(1, 1, fused=True)
        t0 = time.perf_counter()
        R.merge(1, 1, fused=True)
        assert time.perf_counter() - t0 < 10
        assert np.asarray(R.engines[1].errors)[K.POISONED_BY] == 1  # 1 + rank 0
    finally:
        R.close()


def test_merge_waits_only_when_every_rank_has_its_own_gpu(monkeypatch):
    assert I.merge_waits(["0000:01:00.0", "0000:02:00.0"]) is True
    assert I.merge_waits(["0000:01:00.0", "0000:01:00.0"]) is False  # sharing one (MPS)
    assert I.merge_waits([None, None]) is False  # unknown (the simulator)
    assert I.merge_waits([None, None], "merge") is True
    assert I.merge_waits(["a", "b"], "kernel") is False
    monkeypatch.setenv(I.WAIT_ENV, " Kernel ")
    assert I.wait_setting() == "kernel"
    monkeypatch.setenv(I.WAIT_ENV, "sometimes")
    with pytest.raises(ValueError, match="NUMBA_CP_IPC_WAIT='sometimes': expected 'merge'"):
        I.wait_setting()


# ---------------------------------------------------------------------------
# The two-level exchange's fused node level: one node's ranks of a larger world


class NodeRanks:
    """The ranks ``members`` (global ranks of a ``world``-rank exchange) form one node:
    each packs its shard of the global row (addressed by its global rank) into every
    node peer's buffer (addressed by its place in the node), and each merges the
    delivered keys to the node's keys; checked against the oracle's merge_keys."""

    HEADS, TOKENS, TOPK, BLOCKS = 2, 4, 5, 23
    WINDOW = dict(query_len=1, init_blocks=1, local_blocks=1)

    def __init__(self, world, members, timeout=30.0, wait_in_merge=True, method="auto"):
        self.world, self.members, self.method = world, list(members), method
        n = len(self.members)
        self.shape = (self.HEADS, self.TOKENS, self.TOPK)
        self.layout = I.IPCLayout(n, int(np.prod(self.shape)) * 8)
        self.memory = I.HostIPCMemory()
        self.regions = [self.memory.allocate(self.layout.total_bytes) for _ in range(n)]
        self.engines = [I.IPCEngine(i, n, self.layout, self.regions,
                                    self.memory.private_zeros(K.CTRL_WORDS, np.int64),
                                    self.memory.mapped_zeros(K.ERROR_WORDS, np.int64),
                                    timeout=timeout, wait_in_merge=wait_in_merge)
                        for i in range(n)]
        self.out = [np.full(self.shape, -7, np.int64) for _ in range(n)]

    def workload(self, e):
        rng = np.random.default_rng(100 + e)
        scores = rng.standard_normal((self.HEADS, self.TOKENS, self.BLOCKS)).astype(np.float32)
        scores[:, :, rng.integers(0, self.BLOCKS, 3)] = 0.25  # ties across shards
        seq_lens = rng.integers(1, (self.BLOCKS + 2) * 128, self.TOKENS).astype(np.int32)
        return scores, seq_lens

    def shard(self, i, e):
        scores, seq_lens = self.workload(e)
        return ref.shard_scores(scores, rank=self.members[i], world=self.world,
                                global_blocks=self.BLOCKS), seq_lens

    def pack(self, i, e):
        shard, seq_lens = self.shard(i, e)
        d = self.engines[i].delivery()
        ops.local_topk_keys_to_peers(shard, seq_lens, topk=self.TOPK, rank=self.members[i],
                                     world=self.world, global_blocks=self.BLOCKS,
                                     ctrl=d.ctrl, peers=d.peers, data_start=d.data_start,
                                     slot=d.slot, peer_rank=i, method=self.method,
                                     **self.WINDOW)

    def ready(self, i, e):
        n = len(self.members)
        return all(int(f) >= e for f in np.asarray(self.engines[i].own_flags)[:n])

    def merge(self, i, e):
        _, seq_lens = self.workload(e)
        d = self.engines[i].delivery()
        if not d.wait_in_merge:
            d.wait(0)
        ops.merge_delivered_to_keys(d.keys_view(self.shape, slice(None)), seq_lens,
                                    topk=self.TOPK, ctrl=d.ctrl, flags=d.flags,
                                    errors=d.errors, timeout_ns=d.timeout_ns,
                                    block_wait=d.wait_in_merge, out=self.out[i],
                                    method=self.method, **self.WINDOW)
        return self.out[i].copy()

    def expected(self, e):
        """What merge_keys keeps from the node's gathered shard keys (the separate path)."""
        _, seq_lens = self.workload(e)
        window = dict(topk=self.TOPK, global_blocks=self.BLOCKS, **self.WINDOW)
        keys = np.stack([ref.local_topk_keys(self.shard(i, e)[0], seq_lens,
                                             rank=self.members[i], world=self.world, **window)
                         for i in range(len(self.members))])
        return ref.merge_keys(keys, seq_lens, topk=self.TOPK, **self.WINDOW)

    def close(self):
        for region in self.regions:
            self.memory.release(region)


@sim_only
@pytest.mark.parametrize("world, members, wait_in_merge, method", [
    (4, (2, 3), True, "warp"),
    (5, (0, 1, 2), False, "radix"),
    (10, (7, 9), True, "auto"),  # a world wider than one pack's peers, a node of two
    (3, (1,), False, "warp"),  # a node of one rank delivers to itself
])
def test_node_level_delivers_by_node_place_and_merges_to_node_keys(world, members,
                                                                   wait_in_merge, method):
    """The pack's shard is the global rank's (its blocks), its slot and flag the rank's
    place in the node; the delivered merge writes what merge_keys would, on calls that
    alternate the halves, and only the node's flags move."""
    R = NodeRanks(world, members, wait_in_merge=wait_in_merge, method=method)
    n = len(members)
    try:
        for e in (1, 2, 3):
            for i in range(n):
                R.pack(i, e)
            for i in range(n):
                assert R.ready(i, e)
                got = R.merge(i, e)
                want = R.expected(e)
                assert np.count_nonzero(want) > 0
                np.testing.assert_array_equal(got, want, err_msg=f"rank {members[i]}, call {e}")
        for engine in R.engines:
            state = engine.state()
            assert state["epoch"] == 3 and state["error_epoch"] == 0
            assert state["flags"] == [3] * n and state["poisoned_by"] == -1
    finally:
        R.close()


@sim_only
def test_node_level_keys_merge_to_the_global_top_k():
    """Two nodes' delivered node keys, merged as the two-level exchange's last step,
    are the unsharded oracle's ids."""
    world, nodes = 5, ((0, 1, 2), (3, 4))
    made = [NodeRanks(world, members) for members in nodes]
    try:
        for R in made:
            for i in range(len(R.members)):
                R.pack(i, 1)
        node_keys = np.stack([R.merge(0, 1) for R in made])
        scores, seq_lens = made[0].workload(1)
        window = dict(topk=NodeRanks.TOPK, **NodeRanks.WINDOW)
        got = ref.merge_topk_keys(node_keys, seq_lens, **window)
        np.testing.assert_array_equal(
            got, ref.global_topk(scores, seq_lens, global_blocks=NodeRanks.BLOCKS, **window))
    finally:
        for R in made:
            R.close()


@sim_only
@pytest.mark.parametrize("wait_in_merge", [True, False])
def test_node_level_merge_gives_up_then_the_next_pack_poisons(wait_in_merge):
    R = NodeRanks(6, (3, 4, 5), timeout=0.2, wait_in_merge=wait_in_merge)
    try:
        R.pack(0, 1)
        t0 = time.perf_counter()
        R.merge(0, 1)  # the node's other ranks never came: gives up instead of hanging
        assert 0.2 <= time.perf_counter() - t0 < 10
        errors = np.asarray(R.engines[0].errors)
        assert (errors[K.GAVE_UP_EPOCH], errors[K.GAVE_UP_PEER]) == (1, 2)  # node place 1
        R.pack(0, 2)  # poisons every node peer before its keys
        for i in (1, 2):
            assert R.engines[i].state()["poisoned_by"] == 0
        R.engines[1].timeout_ns = 10**15  # a poisoned merge stops waiting, whatever the limit
        R.pack(1, 1)
        t0 = time.perf_counter()
        R.merge(1, 1)
        assert time.perf_counter() - t0 < 10
        assert np.asarray(R.engines[1].errors)[K.POISONED_BY] == 1  # 1 + node place 0
    finally:
        R.close()
