"""Pure parts of benchmarks/profile_step.py: per-thread CPU clocks, phase bookkeeping, SFT progress-line timing
and the tables. The profiled run itself (Ray, Megatron, the engine) is a benchmark, not a test."""

from __future__ import annotations

import io
import os
import time

import pytest

from benchmarks import profile_step as prof
from benchmarks._proc_cpu import ProcessGroups, process_cpu_ns


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_process_cpu_ns_counts_every_thread_of_a_process():
    before = process_cpu_ns(os.getpid())
    _burn(0.05)
    assert process_cpu_ns(os.getpid()) - before >= 40_000_000  # ns
    assert process_cpu_ns(2 ** 22 + 12345) == 0  # no such process: nothing, not an error


class _Clock:
    """A ProcessGroups stand-in whose readings advance by the given amounts."""

    groups = ["driver", "trainer", "engine", "other"]

    def __init__(self):
        self.now = dict.fromkeys(self.groups, 0)

    def refresh(self):
        pass

    def sample(self):
        return dict(self.now)

    def spend(self, **ns):
        for g, v in ns.items():
            self.now[g] += v


def test_phases_and_other_add_up_to_the_step():
    clock = _Clock()
    log = prof.PhaseLog(clock, num_steps=2)
    for _ in range(2):
        log.timed("train", lambda: clock.spend(trainer=30_000_000, driver=1_000_000))
        log.timed("rollout", lambda: clock.spend(engine=20_000_000))
        clock.spend(driver=5_000_000)  # driver work between the calls: the "other" phase
        log.end_step()
    step = log.steps[1]
    assert step["phases"]["train"]["trainer"] == pytest.approx(0.030)
    assert step["phases"]["rollout"]["engine"] == pytest.approx(0.020)
    assert step["phases"]["other"]["driver"] == pytest.approx(0.005)
    assert step["total"]["driver"] == pytest.approx(0.006)
    table = prof.phase_table({"groups": clock.groups, "steps": log.steps, "sft_steps": [dict(
        wall=0.1, driver=0.0, trainer=0.08, engine=0.0, other=0.0)]})
    assert "| train | " in table and "| SFT step | 0.100 | 0.000 | 0.080 |" in table
    assert "| **step** |" in table and table.count("\n") == len(prof.PHASES) + 3


def test_sft_progress_lines_become_per_step_intervals():
    clock = _Clock()
    log = prof.PhaseLog(clock, num_steps=1)
    out = io.StringIO()
    tee = prof.SftLineClock(out, log)
    tee.write("[beamrl] SFT step 1/6: nll 3.6525 (0.2 s)\n")
    clock.spend(trainer=200_000_000)
    tee.write("[beamrl] trainer: unrelated line\n")
    tee.write("[beamrl] SFT step 3/6: nll 1.7031 (0.5 s)\n")  # lines may skip steps: divide by the steps between
    assert out.getvalue().count("\n") == 3  # everything is passed through
    assert len(log.sft_steps) == 1 and log.sft_steps[0]["trainer"] == pytest.approx(0.1)
