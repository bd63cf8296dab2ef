"""The H200 Beam-layer benchmark runs end to end on CPU (`--smoke-cpu`: toy width, forward only; the fused
variant's kernels on Triton's interpreter, set by the script in its own process only)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_smoke_run_of_the_eager_and_fused_layer(tmp_path):
    out = tmp_path / "layer.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "beam_layer.py"), "--smoke-cpu", "--tokens", "16",
                           "--experts", "16", "--iters", "1", "--warmup", "0", "--variants", "eager,fused",
                           "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"eager", "fused"}
    assert all("error" not in r and r["ms"] > 0 for r in results.values()), results
    # The fused layer computes the eager one: measured bit-equal at this width; a broken kernel is O(1) off. The
    # bound leaves room for the norms' documented one-ulp reduction-order differences and a flipped near-tie.
    assert results["eager"]["h_rel_diff_vs_eager"] == 0.0
    assert results["fused"]["h_rel_diff_vs_eager"] <= 1e-2
