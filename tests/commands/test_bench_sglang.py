"""`beamrl bench sync` against the real SGLang CPU engine (two engine starts, one per dtype, each in its own
`beamrl` process: one in-process SGLang engine per process): float32 verifies to <= 1e-4 against the reference
model (FP32 lm_head GEMM, BF16-representable lm_head), bfloat16 by exact agreement with the same engine loaded from
a checkpoint of the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("sglang")
    out = tmp_path_factory.mktemp("bench-sgl-ckpt")
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=3).save_pretrained(out)
    return out


@pytest.mark.parametrize("dtype, transport", [("float32", "colocated"), ("bfloat16", "distributed")])
def test_bench_sync_sglang(checkpoint, tmp_path, dtype, transport):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    p = subprocess.run([sys.executable, "-m", "beamrl.cli", "bench", "sync", "--checkpoint", str(checkpoint),
                        "--engine", "sglang", "--transport", transport, "--dtype", dtype, "--bucket-mb", "0.5",
                        "--device", "cpu", "--timeout", "900", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["verified"] is True, result
    if dtype == "float32":
        assert result["max_abs_logprob_diff_after_sync"] <= 1e-4
    else:
        assert result["max_abs_logprob_diff_after_sync"] == 0.0
        assert result["check"] == "bit-exact vs the engine loaded from a checkpoint"
    before = float(p.stderr.split("before sync ")[1].split(",")[0])
    assert before > 1e-2  # the perturbation was visible before the sync
