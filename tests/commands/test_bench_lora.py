"""`beamrl bench sync --lora`: after the full sync, an adapter-only sync through the same orchestrator into the
native engine (its own process), verified bit for bit against the merged reference, with the bytes of both and
the projection for the 32-GPU LoRA recipe (<= 2 % of a full sync for Beam 501B)."""

import json

import pytest

from beamrl.cli import main
from beamrl.models.beam import preset
from beamrl.models.beam.lora import adapter_num_parameters
from beamrl.models.beam.lora_config import ALL_TARGETS, LoRAConfig

from .test_bench import TRAINING_CODE_PATH, checkpoint  # noqa: F401 - the module fixture

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_sync_lora_reports_adapter_and_full_sync_and_the_501b_projection(checkpoint, tmp_path, capsys,  # noqa: F811
                                                                               dtype):
    out = tmp_path / "result.json"
    rc = main(["bench", "sync", "--checkpoint", str(checkpoint), "--engine", "native", "--transport", "colocated",
               "--dtype", dtype, "--json", str(out), "--bucket-mb", "0.25", "--device", "cpu", "--timeout", "120",
               "--lora", "--lora-rank", "4"])
    result = json.loads(out.read_text())
    lora = result["lora"]
    assert rc == 0 and result["verified"] and lora["verified"], lora["check"]
    assert "bit-identical to the merged reference" in lora["check"] and result["code_path"] == TRAINING_CODE_PATH
    itemsize = 4 if dtype == "float32" else 2
    expected = adapter_num_parameters(preset("tiny"), LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS))
    assert lora["adapter_bytes"] == expected * itemsize + 4  # only the adapters and the FP32 scale travel
    assert lora["full_bytes"] == result["bytes"] and lora["bytes_ratio"] < 0.2
    p = lora["projection"]
    assert p["recipe"] == "lora-grpo-beam501b-dapo-math" and p["adapter_over_full"] <= 0.02
    assert p["all_targets_over_full"] <= 0.02
    assert "projected per sync, lora-grpo-beam501b-dapo-math" in capsys.readouterr().out
