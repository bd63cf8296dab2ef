"""The H200 weight-sync benchmark runs end to end on CPU (`--device cpu`: tiny preset, gloo / shared memory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import expected_tensors

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "distributed"])
def test_cpu_smoke_run_moves_every_byte(tmp_path, mode):
    out = tmp_path / "sync.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_h200.py"), "--mode", mode, "--device", "cpu",
                           "--repeats", "1", "--bucket-mb", "0.0625,2", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    specs = expected_tensors(preset("tiny")).values()  # the tiny state dict in bf16 (router weight/bias FP32)
    total = sum(torch.Size(s.shape).numel() * (4 if s.fp32 else 2) for s in specs)
    assert [(r["mode"], r["bucket_mib"]) for r in rows] == [(mode, 0.0625), (mode, 2.0)]
    for r in rows:
        assert r["checksums_equal"] is True and r["bytes"] == total  # every tensor arrived, bit for bit
        assert r["seconds"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9, rel=1e-9)
    assert rows[0]["buckets"] > rows[1]["buckets"] == 1  # 64 KiB buckets split the 1.4 MB; 2 MiB holds it all
    refs = {"colocated": ["d2d_copy_gbps"], "distributed": ["raw_broadcast_gbps", "peer_copy_gbps"]}[mode]
    assert all(rows[0][k] > 0 for k in refs)
