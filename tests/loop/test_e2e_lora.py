"""End to end on CPU with LoRA (`recipes/quickstart_lora.yaml`, shortened): the weight syncs send only the
adapters (apply mode `adapter`) and the embedded engine serves the trainer's weights (probe within 1e-4 in
float32); the run writes its final adapter in PEFT format; a run killed after its step-2 checkpoint and resumed
reproduces every metric of an uninterrupted run bit for bit."""

import pytest

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora import adapter_num_parameters
from beamrl.models.beam.peft_io import load_peft_adapter
from beamrl.recipe import load_recipe
from tests.loop.e2e_helpers import ROOT, kill_after, metrics, run_train

from .test_e2e_native import _deterministic, _ok

pytestmark = pytest.mark.slow
RECIPE = ROOT / "recipes" / "quickstart_lora.yaml"
ARGS = ("run.num_steps=4", "checkpoint.every_n_steps=2", "sft={steps: 8, lr: 3.0e-3, batch: 32}")


def test_lora_run_syncs_adapters_writes_peft_and_resumes_exactly(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    p = run_train(full, *ARGS, recipe=RECIPE)
    _ok(p)
    want = metrics(full)
    lora = load_recipe(RECIPE).trainer.lora
    config = BeamConfig.from_json_file(full / "sft_checkpoint")
    # Adapter-only syncs: every sync moves the adapters (float32 here) and the scale, nothing else.
    assert all(r["sync/bytes"] == 4 * (adapter_num_parameters(config, lora) + 1) for r in want)
    assert all(r["sync/verify_max_abs_logprob_diff"] <= 1e-4 for r in want)
    saved, tensors = load_peft_adapter(full / "adapter", config)  # the final adapter, PEFT format
    assert saved == lora and len(tensors) > 0
    assert any(r["train/loss"] != 0 for r in want), "degenerate run: every loss is zero"
    kill_after(cut, cut / "checkpoints" / "step_2", *ARGS, recipe=RECIPE)
    p = run_train(cut, *ARGS, resume=True, recipe=RECIPE)
    _ok(p)
    assert f"resumed from {cut / 'checkpoints' / 'step_2'}" in p.stdout
    got = [_deterministic(r) for r in metrics(cut)]
    assert [g["step"] for g in got] == [0, 1, 2, 3]
    assert got == [_deterministic(r) for r in want]  # every metric of every step, bit for bit

