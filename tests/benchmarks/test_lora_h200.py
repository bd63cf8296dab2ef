"""The H200 LoRA benchmark runs end to end at tiny sizes on CPU (`--device cpu --tiny`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_tiny_smoke_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_h200.py"), "--device", "cpu", "--tiny"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "lora_h200.json").read_text())
    sizes = results["sizes_501b"]
    assert sizes["all"]["adapter_over_full"] <= 0.02  # issue 18: adapter sync <= 2 % of a full sync
    assert sizes["attention"]["adapter_bytes"] == 76_677_120 * 2
    train = results["lora_train_small"]
    assert train["trainable_params"] > 0 and train["frozen_params"] > train["trainable_params"]
    assert len(train["losses"]) == 2 and train["fwd_bwd_tokens_per_s"] > 0
    apply = results["adapter_apply"]
    assert apply["adapter_bytes"] > 0 and apply["sync_s"] > 0 and apply["sync_bytes"] == apply["adapter_bytes"] + 4 and apply["merged_bytes"] > apply["adapter_bytes"]
    assert "adapter_apply" in proc.stdout and "501B r32 all" in proc.stdout
