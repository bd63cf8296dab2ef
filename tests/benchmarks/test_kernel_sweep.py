"""The kernel launch sweep runs on the Triton interpreter, and every tuning choice it tries gives the defaults'
outputs (so a choice picked from an H200 sweep can never change a result beyond a reduction order)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_smoke_every_candidate_matches_the_defaults(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sweep.py"), "--smoke-cpu", "--tokens", "4",
                           "--hidden", "40", "--heads", "2", "--kv-heads", "2", "--head-dim", "16", "--intermediate",
                           "24", "--only", "swiglu", "output_gate", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"swiglu", "output_gate"}
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert all(r["matches_default"] for r in rows), [r["config"] for r in rows if not r["matches_default"]]
    assert {r["kind"] for r in rows} == {"default", "rounding", "fwd", "bwd"}
