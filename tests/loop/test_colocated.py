"""The colocated hand-over order (`beamrl.loop.colocated`) and `trainer.sleep_during_rollout`'s default.

The groups here only record calls (the real `TrainerGroup` / `EngineGroup` run the same calls in
tests/loop/test_colocated_sleep.py, end to end)."""

import copy

import pytest

from beamrl.loop.colocated import KV_TAGS, ColocatedMemory, engines_back_up_weights, trainer_sleeps
from beamrl.recipe import apply_override, validate_recipe
from tests.recipe.conftest import BASE

REPORT = {"seconds": 0.1, "bytes": 2**30, "storages": 3, "asleep_bytes": 2**20, "awake_bytes": 2**31,
          "peak_bytes": 2**32}


class Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def sleep(self, timeout):
        self.log.append(f"{self.name}.sleep")
        return [REPORT]

    def wake(self, timeout):
        self.log.append(f"{self.name}.wake")
        return [REPORT]

    def call_all(self, method, timeout, tags):
        self.log.append(f"{self.name}.{method}({tags})")


def _memory(sleep: bool, staged: bool):
    log: list = []
    m = ColocatedMemory([Recorder("trainer", log), Recorder("reference", log)], Recorder("engines", log),
                        sleep=sleep, staged=staged, timeout=5)
    return m, log


def test_staged_order_with_a_sleeping_trainer():
    m, log = _memory(sleep=True, staged=True)
    first = m.before_rollout()  # step 0: the engines never released anything yet
    assert log == ["trainer.sleep", "reference.sleep"]
    assert first["memory/trainer_asleep_gib"] == 2**20 / 2**30 and first["memory/trainer_peak_gib"] == 4.0
    log.clear()
    m.before_train()
    assert log == ["engines.release_memory(None)", "trainer.wake", "reference.wake"]
    assert m.resume_after_sync == ()  # the sync resumes only the weights: KV waits for the trainer's sleep
    log.clear()
    out = m.before_rollout()
    assert log == ["trainer.sleep", "reference.sleep", f"engines.resume_memory({list(KV_TAGS)})"]
    assert {"time/trainer_sleep_s", "time/engine_resume_kv_s", "memory/trainer_offloaded_gib"} <= set(out)


def test_without_sleep_the_sync_resumes_everything():
    m, log = _memory(sleep=False, staged=True)
    assert m.before_rollout() == {} and log == []
    m.before_train()
    assert log == ["engines.release_memory(None)"]
    assert m.resume_after_sync == KV_TAGS
    m2, log2 = _memory(sleep=False, staged=False)
    assert m2.before_train() == {} and m2.before_rollout() == {} and log2 == []


@pytest.mark.parametrize("overrides, sleeps", [
    ([], False),  # the base recipe is disaggregated
    (["placement.mode=colocated", "sync.transport=colocated", "trainer.num_gpus=16", "trainer.global_batch_size=32",
      "rollout.num_engines=8", "rollout.engine_tp=2"], True),  # colocated on cuda: on by default
    (["placement.mode=colocated", "sync.transport=colocated", "trainer.num_gpus=16", "trainer.global_batch_size=32",
      "rollout.num_engines=8", "rollout.engine_tp=2", "trainer.sleep_during_rollout=false"], False),
])
def test_sleep_default(overrides, sleeps):
    raw = copy.deepcopy(BASE)
    for o in overrides:
        apply_override(raw, o)
    assert trainer_sleeps(validate_recipe(raw)) is sleeps


def test_only_lora_engines_back_up_released_weights():
    """Full syncs resend every weight after a release, so the engines drop what they release; LoRA's adapter-only
    syncs do not resend the base: those engines keep a host copy. The rule reaches each engine's launch."""
    from pathlib import Path

    from beamrl.recipe.load import load_recipe

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    assert not engines_back_up_weights(load_recipe(recipes / "quickstart.yaml", []))
    assert engines_back_up_weights(load_recipe(recipes / "quickstart_lora.yaml", []))
    raw = copy.deepcopy(BASE)
    assert not engines_back_up_weights(validate_recipe(raw))


def test_engine_factories_carry_the_backup_rule():
    """`setup.engine_factories` gives every engine's launch the run's rule (LoRA: keep a host copy)."""
    from pathlib import Path
    from types import SimpleNamespace

    from beamrl.loop.setup import engine_factories
    from beamrl.recipe.layout import placement_of
    from beamrl.recipe.load import load_recipe

    class OneNode:
        def gpu_ids(self, node):
            return None

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    for name, backup in (("quickstart.yaml", False), ("quickstart_lora.yaml", True)):
        r = load_recipe(recipes / name, [])
        run = SimpleNamespace(recipe=r, cpu=True, return_routed_experts=True, api_key="k", placement=placement_of(r),
                              groups=OneNode())
        launches = [f.launch for node in engine_factories(run, "/ckpt") for f in node]
        assert launches and all(la.weights_cpu_backup is backup for la in launches)


def test_launch_backup_reaches_the_native_engine(tmp_path):
    from pathlib import Path

    import torch

    from beamrl.models.beam import BeamForCausalLM, preset
    from beamrl.recipe.load import load_recipe
    from beamrl.rollout.engines import EngineLaunch, build_native_engine

    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(tmp_path)
    rollout = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml", []).rollout
    for backup in (False, True):
        engine = build_native_engine(rollout, EngineLaunch(checkpoint=str(tmp_path), dtype="float32", device="cpu",
                                                           seed=0, name="n", start_timeout=60,
                                                           return_routed_experts=True, weights_cpu_backup=backup))
        assert engine.config.weights_cpu_backup is backup
        engine.shutdown()
