"""LoRA in recipes: `trainer.lora` is validated at load with errors naming the dotted field, the 32-GPU LoRA recipe
passes the dry run with adapter-only syncs within 2 % of a full sync, and the memory model counts gradients and
Adam state for the adapters only."""

import pytest

from beamrl.models.beam import preset
from beamrl.models.beam.lora_config import ALL_TARGETS
from beamrl.recipe import RecipeError, load_recipe
from beamrl.recipe.dry_run import dry_run
from beamrl.recipe.layout import plan_layout
from beamrl.recipe.memory import engine_memory, trainer_memory
from beamrl.recipe.sync_time import adapter_sync_bytes, model_bytes

RECIPE = "lora_grpo_dapo_math"


@pytest.mark.parametrize("override,path", [("trainer.lora.rank=0", "trainer.lora.rank"),
                                           ("trainer.lora.dropout=0.1", "trainer.lora.dropout"),
                                           ("trainer.lora.targets=[mlp.gate]", "trainer.lora.targets[0]"),
                                           ("trainer.lora.rnak=4", "trainer.lora.rnak")])
def test_bad_lora_field_names_its_dotted_path(override, path):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, [override])
    assert err.value.path == path


def test_lora_recipe_dry_run_and_adapter_sync_bytes():
    r = load_recipe(RECIPE)
    c = preset("beam-501b")
    report = dry_run(r, checks=False).report
    assert "every sync is adapter-only" in report and "LoRA W0 copies" in report
    full, _ = model_bytes(c, "bfloat16")
    assert adapter_sync_bytes(c, r.trainer.lora, "bfloat16") <= 0.02 * full * 0.01  # attention: < 0.02 %
    every = load_recipe(RECIPE, [f"trainer.lora.targets=[{','.join(ALL_TARGETS)}]"]).trainer.lora
    assert adapter_sync_bytes(c, every, "bfloat16") <= 0.02 * full  # every target kind: still <= 2 %


def test_lora_memory_counts_grads_and_adam_for_adapters_only():
    c = preset("beam-501b")
    lora, full = load_recipe(RECIPE), load_recipe(RECIPE, ["trainer.lora=null"])
    (m,), (f,) = (trainer_memory(r, c, plan_layout(r, c)) for r in (lora, full))
    assert m.grads + m.optimizer < 0.01 * m.weights  # only the adapters train
    assert f.grads + f.optimizer > 4 * f.weights  # full-parameter: FP32 grads + Adam for every weight
    assert 0 < m.weights - f.weights < 0.01 * f.weights  # the adapters' own weights
    assert engine_memory(lora, c, plan_layout(lora, c)).lora_w0 > 0 == engine_memory(full, c,
                                                                                         plan_layout(full, c)).lora_w0
