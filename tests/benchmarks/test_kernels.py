"""The H200 kernel benchmark runs end to end on CPU (`--smoke-cpu`: toy widths on Triton's interpreter, set by the
script in its own process only) and its fused outputs keep the rounding contract against eager."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPS = ["post_norm_residual_pre_norm", "qk_norm_rope", "qk_norm_ssmax", "output_gate", "route (GEMM + grouped top-k)",
       "grouped top-k only (logits given)", "swiglu [T*8, 2*2560]", "moe combine [T*8, H] -> [T, H]"]


@pytest.mark.slow
def test_cpu_smoke_run_covers_every_kernel_within_the_rounding_contract(tmp_path):
    out = tmp_path / "kernels.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--smoke-cpu", "--iters", "1",
                           "--tokens", "4", "--hidden", "40", "--heads", "2", "--kv-heads", "2", "--head-dim", "16",
                           "--experts", "16", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["op"], r["backend"]) for r in rows) == sorted((op, b) for op in OPS for b in ("eager", "triton"))
    fused = {r["op"]: r["mismatch"] for r in rows if r["backend"] == "triton"}
    # docs/kernels.md: the gate, SwiGLU and the combine are bit-equal to eager; the norms differ by FP32 reduction
    # order in a few elements; the router's weights within 2 FP32 ulp (its ids are equal)
    for op in ("output_gate", "swiglu [T*8, 2*2560]", "moe combine [T*8, H] -> [T, H]"):
        assert all(m["mismatches"] == 0 for m in fused[op].values()), (op, fused[op])
    for op in ("post_norm_residual_pre_norm", "qk_norm_rope", "qk_norm_ssmax"):
        assert all(m["mismatches"] <= 0.01 * m["numel"] for m in fused[op].values()), (op, fused[op])
    route = fused["route (GEMM + grouped top-k)"]  # weights in sorted-id order: other ids would be far off
    assert set(route) == {"out0"} and route["out0"]["max_ulp"] <= 2, route
