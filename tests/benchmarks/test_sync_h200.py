"""The H200 weight-sync benchmark runs end to end on CPU (`--device cpu`: tiny preset, shared memory / gloo) through
the training orchestrator, with the receiver in its own process, checksums equal after every sync."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("mode, transport_mode", [("colocated", "staged"), ("distributed", "distributed")])
def test_cpu_smoke_run(tmp_path, mode, transport_mode):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_h200.py"), "--mode", mode, "--device", "cpu",
                        "--repeats", "1", "--bucket-mb", "0.0625,1", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["bucket_mib"] for r in rows] == [0.0625, 1.0]
    assert rows[0]["buckets"] > rows[1]["buckets"] >= 1
    for r in rows:
        assert r["checksums_equal_every_sync"] is True and r["transport_mode"] == transport_mode
        assert r["gbps_best"] > 0 and r["code_path"].startswith("beamrl.sync.orchestrator.WeightSync")
    assert list(result["references"]) == (["d2d_copy_gbps"] if mode == "colocated"
                                          else ["raw_broadcast_gbps", "peer_copy_gbps"])
    assert "checksums equal after 2 syncs" in p.stdout and "| sync / reference |" in p.stdout
