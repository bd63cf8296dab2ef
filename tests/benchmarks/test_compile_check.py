"""`benchmarks/compile_check.py` compiles the Triton kernels for H200 (sm_90) and B200 (sm_100) on a CPU-only machine
through Triton's own ptxas (the CPU smoke test of the GPU-free compile: one kernel per architecture here).

It runs in a process of its own, as a user runs it: this test process imported Triton's library on the CPU
interpreter (tests/conftest.py), and a GPU compile there fails in Triton's code generator. An empty Triton cache
makes it compile for real: a cached kernel from an earlier run would skip the code generator and hide that."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_compiles_for_h200_and_b200(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--arch", "90,100",
                           "--only", "swiglu fwd", "--registers"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cc in (90, 100):
        line = next(ln for ln in proc.stdout.splitlines() if f"sm_{cc} swiglu fwd" in ln)
        assert line.startswith("ok") and "regs=" in line and "regs=?" not in line
    assert any((tmp_path / "triton-cache").rglob("*.ptx"))  # compiled here, not taken from a cache
