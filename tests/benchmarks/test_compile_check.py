"""`benchmarks/compile_check.py` compiles the Triton kernels for H200 (sm_90) and B200 (sm_100) on a CPU-only machine
through Triton's own ptxas (the CPU smoke test of the GPU-free compile: one kernel per architecture here)."""

import pytest

pytest.importorskip("triton")


def test_compiles_for_h200_and_b200(capsys):
    from benchmarks.compile_check import main

    assert main(["--arch", "90,100", "--only", "swiglu fwd", "--registers"]) == 0
    out = capsys.readouterr().out
    for cc in (90, 100):
        line = next(ln for ln in out.splitlines() if f"sm_{cc} swiglu fwd" in ln)
        assert line.startswith("ok") and "regs=" in line and "regs=?" not in line
