"""benchmarks/bench_kernels.py's eager rounds, with stand-in calls (no GPU needed)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_kernels  # noqa: E402
import pytest  # noqa: E402
from bench_kernels import EagerRounds  # noqa: E402


class CountingStream:
    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1


class Clock:
    """A stand-in for time.perf_counter that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class QueueStream:
    """A stream whose synchronisation waits out the work queued on it."""

    def __init__(self, clock, kernel_s):
        self.clock, self.kernel_s, self.queued, self.started = clock, kernel_s, 0, 0.0

    def synchronize(self):
        # the GPU ran alongside the host: it ends a kernel_s per call after the first call
        busy = self.queued * self.kernel_s
        self.clock.now = max(self.clock.now, self.started + busy)
        self.queued = 0


def test_a_call_registered_late_gets_as_many_rounds_as_the_first():
    eager = EagerRounds(calls=3)
    made = {"early_eager_us": 0, "late_eager_us": 0}
    row = {}
    stream = CountingStream()

    def counting(name):
        def call(_stream):
            made[name] += 1
        return call

    eager.add(row, "early_eager_us", counting("early_eager_us"), stream)  # one untimed call each
    for _ in range(4):  # four cases, as run_case registers them
        eager.run_round()
    eager.add(row, "late_eager_us", counting("late_eager_us"), stream)
    eager.run_round()
    eager.finish(2, pause_s=0)
    # early: 5 rounds, then 2 more; late: 1 round, then 6 to catch up and the same 2
    assert made == {"early_eager_us": 1 + 7 * 3, "late_eager_us": 1 + 7 * 3}
    assert set(row) == {"early_eager_us", "early_host_us", "late_eager_us", "late_host_us"}
    assert stream.synced == 2 + 7 + 7  # each round ends in one synchronisation


def test_the_best_round_is_kept(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench_kernels.time, "perf_counter", clock)
    took_us = iter([7.0, 5.0, 3.0, 4.0])  # the untimed call's, then three rounds' calls

    def call(_stream):
        clock.now += next(took_us) * 1e-6

    eager = EagerRounds(calls=1)
    row = {}
    stream = CountingStream()
    eager.add(row, "merge_eager_us", call, stream)
    eager.finish(3, pause_s=0)
    assert stream.synced == 1 + 3
    assert row == {"merge_eager_us": pytest.approx(3.0), "merge_host_us": pytest.approx(3.0)}


@pytest.mark.parametrize("host_us, kernel_us, eager_us", [
    (10.0, 19.0, 19.0),  # the kernel is the slower side: the round waits for it
    (10.0, 3.0, 10.0),  # the host is: the synchronisation finds the work done
])
def test_the_host_figure_ends_where_the_last_call_returned(monkeypatch, host_us, kernel_us,
                                                           eager_us):
    clock = Clock()
    monkeypatch.setattr(bench_kernels.time, "perf_counter", clock)
    stream = QueueStream(clock, kernel_us * 1e-6)

    def call(stream):
        if not stream.queued:
            stream.started = clock.now
        stream.queued += 1
        clock.now += host_us * 1e-6

    eager = EagerRounds(calls=100)
    row = {}
    eager.add(row, "world1_eager_torch_us", call, stream)
    eager.run_round()
    assert row["world1_host_torch_us"] == pytest.approx(host_us)
    assert row["world1_eager_torch_us"] == pytest.approx(eager_us)


def test_a_key_that_names_no_eager_call_is_refused():
    with pytest.raises(ValueError, match="names it eager"):
        EagerRounds(calls=1).add({}, "merge_us", lambda _stream: None, CountingStream())
