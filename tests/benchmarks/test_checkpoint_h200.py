"""The H200 checkpoint benchmark runs end to end at tiny sizes on CPU (`--device cpu --tiny`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_tiny_smoke_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint_h200.py"), "--device", "cpu",
                           "--tiny", "--json", str(out), "--dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["load_matches_saved"] is True
    assert r["checkpoint_bytes"] > r["params"] * 10  # weights + FP32 main copies + two moments
    for key in ("sync_save_s", "async_save_blocking_s", "async_save_total_s", "load_s", "verify_s", "step_s"):
        assert r[key] > 0, key
    assert r["steps_during_async_save"] >= 1 and r["async_save_total_s"] >= r["async_save_blocking_s"]
    assert "save, async: step waits" in proc.stdout
    phases = ["trainer built", "steps without a save", "sync save", "async save", "load"]
    for phase in phases:
        assert f"] {phase} " in proc.stdout, phase  # progress lines, so a run cut short shows what it measured
    assert r["phases_done"] == phases  # the JSON is rewritten after each phase
    for key in ("sync_save_costs", "async_save_costs"):  # the trainer's per-phase costs of each save
        c = r[key]
        # Every file but beamrl_checkpoint.json (the manifest holding the others' sizes) is counted.
        assert 0 < r["checkpoint_bytes"] - c["bytes"] < 1 << 20 and c["data_files"] >= 1, key
        assert 0 < c["write_wall_s"] <= c["total_s"] and c["state_s"] > 0, key
    assert r["async_save_costs"]["step_waited_s"] < r["async_save_costs"]["total_s"]
    assert 0 < r["load_costs"]["verify_s"] < r["load_s"]
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # the checkpoints were removed

