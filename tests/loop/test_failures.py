"""What a user can break: recipe fields, data files, reward plugins, engines. Each gives a clear message or a
counted failure, and nothing is lost."""

import time

import pytest
import ray

from tests.loop.e2e_helpers import metrics, run_train


def test_bad_recipe_field_names_the_field(tmp_path):
    p = run_train(tmp_path / "run", "rollout.temprature=0.5", timeout=300)
    assert p.returncode == 2
    assert "rollout.temprature" in p.stderr + p.stdout


def test_missing_dataset_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    p = run_train(tmp_path / "run", "data.format=jsonl-prompt-answer", f"data.source={missing}", "data.synthetic=null",
                  timeout=300)
    assert p.returncode != 0
    assert str(missing) in p.stderr + p.stdout


@pytest.mark.slow
def test_reward_that_raises_or_hangs_is_counted_and_the_run_goes_on(tmp_path):
    rewards = ("rewards=[{name: exact, fn: 'beamrl.rewards.exact:exact_match'}, "
               "{name: broken, fn: 'tests.loop.flaky_rewards:always_raises', on_error: zero}, "
               "{name: stuck, fn: 'tests.loop.flaky_rewards:hangs', on_error: zero, timeout_s: 1}]")
    p = run_train(tmp_path / "run", "run.num_steps=2", "rollout.n_samples_per_prompt=2",
                  "trainer.global_batch_size=8", "trainer.micro_batch_size=8", rewards, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["reward/broken/errors"] == 8  # every sample counted, none lost
        assert r["reward/stuck/timeouts"] == 8
        assert "reward/exact/mean" in r


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    from beamrl.loop.ray_utils import init_local_ray

    init_local_ray(num_cpus=2, temp_dir=tmp_path_factory.mktemp("ray"))
    yield
    ray.shutdown()


@pytest.mark.slow
def test_dead_engine_fails_fast_with_its_name(tmp_path, local_ray):
    import torch

    from beamrl.loop.components import NativeEngineFactory
    from beamrl.loop.groups import EngineGroup
    from beamrl.loop.ray_utils import ActorCallError
    from beamrl.models.beam import preset
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.rollout.protocol import GenerateRequest, SamplingParams

    cfg = preset("tiny").replace(dtype="float32")
    save_checkpoint(cfg, random_state_dict(cfg, 0, torch.float32), tmp_path / "ckpt")
    group = EngineGroup([NativeEngineFactory(str(tmp_path / "ckpt"), "float32", "cpu", 0, "native-0")], 120,
                        [{"num_cpus": 1}])
    req = [[GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0))]]
    assert len(group.generate(req, 60)[0]) == 1
    ray.kill(group.actors[0])
    t0 = time.monotonic()
    with pytest.raises(ActorCallError, match="native-0.generate"):
        group.generate(req, 600)
    # Noticed as a death, not by the 600 s deadline (the bound leaves a loaded machine plenty of room)
    assert time.monotonic() - t0 < 300
