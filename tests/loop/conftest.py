"""Uninterrupted `beamrl train` runs that several end-to-end tests assert on (each costs a Ray cluster, the Megatron
trainer and an engine: run once per session, never modified by a test; a test that writes copies the directory).

Both start from a short SFT warm start, so rewards, losses and gradients are not all zero and comparisons of runs
can fail."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.loop.e2e_helpers import run_train

SFT = "sft={steps: 8, lr: 3.0e-3, batch: 32}"
# Colocated native engine, 4 steps, a checkpoint every 2 steps (step_2, step_4).
COLOCATED_ARGS = ("run.num_steps=4", "checkpoint.every_n_steps=2", SFT)
# Disaggregated native engine (its own worker slot) synced over the distributed transport, 3 steps.
DISAGGREGATED_ARGS = ("run.num_steps=3", "placement.mode=disaggregated", "sync.transport=distributed",
                      "cluster.gpus_per_node=2", SFT)


@dataclass(frozen=True)
class FinishedRun:
    out: Path  # the run's output directory (read only: copy it to write)
    stdout: str
    args: tuple[str, ...]  # the overrides it ran with (after e2e_helpers.SMALL)


def _finished(out: Path, args: tuple[str, ...]) -> FinishedRun:
    p = run_train(out, *args)
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return FinishedRun(out, p.stdout, args)


@pytest.fixture(scope="session")
def colocated_run(tmp_path_factory) -> FinishedRun:
    """The quickstart (e2e_helpers.SMALL) with `COLOCATED_ARGS`, run to the end."""
    return _finished(tmp_path_factory.mktemp("colocated") / "run", COLOCATED_ARGS)


@pytest.fixture(scope="session")
def disaggregated_run(tmp_path_factory) -> FinishedRun:
    """The quickstart (e2e_helpers.SMALL) with `DISAGGREGATED_ARGS`, run to the end."""
    return _finished(tmp_path_factory.mktemp("disaggregated") / "run", DISAGGREGATED_ARGS)
