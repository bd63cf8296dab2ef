"""The CPU smoke run of benchmarks/two_gpu_h200.py, once per session: its `sync` and `teardown` stages are the
same `benchmarks/sync_h200.py` commands that test_sync_h200.py checks (`--mode distributed` / `--mode teardown`
with the smoke arguments), so that module reads their outputs instead of running them again."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TwoGpuSmoke:
    out: Path  # the script's --out: per-stage logs (stdout and stderr), JSON, the rl run (read only)
    proc: subprocess.CompletedProcess

    def stage(self, name: str) -> tuple[dict, str]:
        """Stage `name`'s summary entry (rc, command, seconds) and its log; fails the test if the stage failed."""
        import json

        summary = json.loads((self.out / "two_gpu_h200.json").read_text())
        (entry,) = [s for s in summary["stages"] if s["stage"] == name]
        log = (self.out / f"{name}.log").read_text()
        assert entry["rc"] == 0, f"two_gpu_h200.py stage {name} failed (rc={entry['rc']}):\n{log[-3000:]}"
        return entry, log


@pytest.fixture(scope="session")
def two_gpu_smoke(tmp_path_factory) -> TwoGpuSmoke:
    """`benchmarks/two_gpu_h200.py --smoke`, all four stages (a failing stage does not stop the others)."""
    out = tmp_path_factory.mktemp("two-gpu-smoke")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "two_gpu_h200.py"), "--smoke", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    return TwoGpuSmoke(out, proc)
