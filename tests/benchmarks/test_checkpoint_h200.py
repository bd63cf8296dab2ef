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
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # the checkpoints were removed
