"""benchmarks/bench_kernels.py's eager rounds, with stand-in calls (no GPU needed)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_kernels import EagerRounds  # noqa: E402


class CountingStream:
    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1


def test_a_call_registered_late_gets_as_many_rounds_as_the_first():
    eager = EagerRounds(calls=3)
    made = {"early": 0, "late": 0}
    row = {}
    stream = CountingStream()

    def counting(name):
        def call(_stream):
            made[name] += 1
        return call

    eager.add(row, "early", counting("early"), stream)  # one untimed call each
    for _ in range(4):  # four cases, as run_case registers them
        eager.run_round()
    eager.add(row, "late", counting("late"), stream)
    eager.run_round()
    eager.finish(2, pause_s=0)
    # early: 5 rounds, then 2 more; late: 1 round, then 6 to catch up and the same 2
    assert made == {"early": 1 + 7 * 3, "late": 1 + 7 * 3}
    assert row["early"] >= 0 and row["late"] >= 0
    assert stream.synced == 2 + 7 + 7  # each round ends in one synchronisation


def test_the_best_round_is_kept():
    eager = EagerRounds(calls=1)
    row = {"merge": 0.5}  # a figure no round can beat: min keeps it
    eager.add(row, "merge", lambda _stream: None, CountingStream())
    eager.finish(3, pause_s=0)
    assert row["merge"] == 0.5
