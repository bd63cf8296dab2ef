"""What a user can break: recipe fields, data files, reward plugins, engines. Each gives a clear message or a
counted failure, and nothing is lost."""

import os
import time

import pytest
import ray

from tests.loop.e2e_helpers import metrics, run_train


def test_bad_recipe_field_names_the_field(tmp_path):
    p = run_train(tmp_path / "run", "rollout.temprature=0.5", timeout=300)
    assert p.returncode == 2
    assert "rollout.temprature" in p.stderr + p.stdout


def _one_line_and_nothing_written(p, out) -> str:
    """A start-up failure a user caused: exit 2, one line on stderr, before Ray or any output."""
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-4000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "starting Ray" not in p.stdout and not out.exists()
    return lines[0]


def test_missing_dataset_file_names_data_source_and_the_file_and_writes_nothing(tmp_path):
    missing, out = tmp_path / "nope.jsonl", tmp_path / "run"
    p = run_train(out, "data.format=jsonl-prompt-answer", f"data.source={missing}", "data.synthetic=null", timeout=300)
    assert _one_line_and_nothing_written(p, out) == (f"beamrl train: data.source='{missing}': no such file or "
                                                     f"directory: {missing}")


def test_a_checkpoint_missing_a_tensor_is_one_line_before_ray(tmp_path):
    from safetensors.torch import load_file, save_file

    from beamrl.cli import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(ckpt), "--dtype", "float32",
                 "--tokenizer", "byte"]) == 0
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.4.mlp.experts.7.down_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    p = run_train(out, "model.preset=null", "model.seed=null", "model.config_overrides={}", f"model.checkpoint={ckpt}",
                  "data.tokenizer=null", timeout=300)
    assert _one_line_and_nothing_written(p, out) == (
        f"beamrl train: model.checkpoint='{ckpt}': tensor 'model.layers.4.mlp.experts.7.down_proj.weight' missing "
        "(1 missing in all) (read from the safetensors headers)")


def test_a_misspelt_reward_module_is_one_line_naming_the_component(tmp_path):
    out = tmp_path / "run"
    p = run_train(out, "rewards.0.fn=beamrl.rewards.exakt:exact_match", timeout=300)
    line = _one_line_and_nothing_written(p, out)
    assert line.startswith("beamrl train: rewards[0].fn='beamrl.rewards.exakt:exact_match': cannot import module "
                           "'beamrl.rewards.exakt'")


def test_a_bad_resume_is_one_line(tmp_path):
    out = tmp_path / "run"
    p = run_train(out, resume=True, timeout=300)
    assert _one_line_and_nothing_written(p, out) == (f"beamrl train: run.output_dir='{out}': --resume: no earlier run "
                                                     "there to continue (start it without --resume)")


@pytest.mark.slow
def test_a_hanging_reward_costs_the_others_nothing_and_the_step_about_one_timeout(tmp_path):
    """The quickstart with a user's four reward components: an exact match with a metric, one that raises on
    some samples, one that hangs (2 s per-call timeout), an async one that always returns 0.5."""
    m = "tests.loop.flaky_rewards"
    rewards = (f"rewards=[{{name: match, fn: '{m}:match_with_metric'}}, {{name: raiser, fn: '{m}:raises_on_some'}}, "
               f"{{name: stuck, fn: '{m}:hangs', timeout_s: 2}}, {{name: half, fn: '{m}:async_half'}}]")
    p = run_train(tmp_path / "run", "run.num_steps=2", "rollout.n_samples_per_prompt=2",
                  "trainer.global_batch_size=8", "trainer.micro_batch_size=8", rewards,
                  "reward_pool.batch_timeout_s=60", timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    n = 8  # samples per step
    for r in rows:
        # The healthy components lose nothing: every sample scored, no timeouts.
        assert r["reward/half/mean"] == 0.5 and r["reward/half/count"] == n and r["reward/half/timeouts"] == 0
        assert r["reward/match/count"] == n and r["reward/match/timeouts"] == 0 and r["reward/match/errors"] == 0
        assert "reward/match/length" in r
        assert r["reward/raiser/timeouts"] == 0 and r["reward/raiser/skipped"] == 0
        assert r["reward/raiser/breaker_tripped"] == 0
        # The hanging one trips its breaker in both steps (the second step retried it first).
        assert r["reward/stuck/breaker_tripped"] == 1 and r["reward/stuck/timeouts"] >= 3
        assert r["reward/stuck/timeouts"] + r["reward/stuck/skipped"] == n
        assert r["reward/mean"] == pytest.approx(r["reward/match/mean"] + r["reward/raiser/mean"] + 0.5)
        # About one per-call timeout (2 s) plus worker restarts; far from the 60 s batch timeout.
        assert r["reward/wall_s"] < 30, r["reward/wall_s"]
    trips = [ln for ln in p.stdout.splitlines() if "reward 'stuck': circuit breaker tripped after 3" in ln]
    retries = [ln for ln in p.stdout.splitlines() if "reward 'stuck': retrying" in ln]
    assert len(trips) == 2 and len(retries) == 1, p.stdout[-4000:]
    assert all("did not return within 2 s" in ln for ln in trips)


@pytest.fixture(scope="module")
def local_ray(ray_temp_dir):
    from beamrl.cluster.ray_start import init_local_ray

    init_local_ray(num_cpus=2, temp_dir=ray_temp_dir)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("express", [False, True], ids=["ray", "express"])
def test_dead_engine_fails_fast_with_its_name(tmp_path, local_ray, express):
    """Also with express calls (docs/express-calls.md): a call to an engine that died while idle is issued all the
    same and fails as a death, as a Ray call does (not with an error of the channel's own)."""
    import torch

    from beamrl.loop.groups import EngineGroup, open_express
    from beamrl.loop.ray_utils import ActorCallError
    from beamrl.models.beam import preset
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.protocols.rollout import GenerateRequest, SamplingParams
    from beamrl.rollout.config import RolloutConfig
    from beamrl.rollout.engines import EngineLaunch, engine_factory

    cfg = preset("tiny").replace(dtype="float32")
    save_checkpoint(cfg, random_state_dict(cfg, 0, torch.float32), tmp_path / "ckpt")
    rollout = RolloutConfig(engine="native", max_new_tokens=2, n_samples_per_prompt=1, prompts_per_step=1)
    launch = EngineLaunch(checkpoint=str(tmp_path / "ckpt"), dtype="float32", device="cpu", seed=0, name="native-0",
                          port=0, start_timeout=120, return_routed_experts=False)
    group = EngineGroup([[engine_factory(rollout, launch)]], 120, [[{"num_cpus": 1}]])
    if express:
        assert open_express([], group, True).startswith("actor calls: express")
    req = [[GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0))]]
    assert len(group.generate(req, 60)[0]) == 1
    pid = group.pids(0)[0]
    ray.kill(group.actors[0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:  # the process is gone before the calls below are made
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    for _ in range(2):  # the first call finds the engine dead, the second one a channel already known lost
        with pytest.raises(ActorCallError, match="native-0.generate"):
            group.generate(req, 600)
    # Noticed as a death, not by the 600 s deadline (the bound leaves a loaded machine plenty of room)
    assert time.monotonic() - t0 < 300


@pytest.mark.slow
@pytest.mark.parametrize("express", [False, True], ids=["ray", "express"])
def test_a_busy_engine_answers_health_checks_and_shuts_down_at_once(local_ray, express):
    """A `generate` that runs for minutes must not make its engine look dead: health checks and process ids are
    answered while it runs (the loop checks engines every `rollout.health_check_interval_s` during a rollout), and
    shutting a wedged engine down does not queue behind the call it is stuck in (its shutdown ends that call). Also
    with the generate sent as an express call (docs/express-calls.md): the liveness calls stay outside the engine's
    `serial` lock, and the shutdown may hang up on the waiting caller instead of answering it."""
    import threading

    from beamrl.loop.actors import EngineActor
    from beamrl.loop.express import ExpressClient, ExpressPeerLost
    from beamrl.loop.ray_utils import ray_get

    class Busy:  # an engine whose generation runs until it is shut down (defined here: pickled by value for Ray)
        def __init__(self):
            self.stopped = threading.Event()

        def generate(self, requests, timeout):
            return "stopped" if self.stopped.wait(timeout) else "ran out"

        def health(self, timeout):
            return not self.stopped.is_set()

        def shutdown(self):
            self.stopped.set()

    class Factory:
        name = "busy"

        def with_launch(self, **_):
            return Busy

    actor = EngineActor.options(num_cpus=0).remote(factory=Factory())
    try:
        ray_get(actor.start.remote(host="127.0.0.1", port=0, dist_init_addr=None), 60, "start")
        if express:
            client = ExpressClient(ray_get(actor.open_express.remote(), 60, "open_express"), "busy")
            busy = client.call_async("call", "generate", requests=[], timeout=120)
        else:
            busy = actor.call.remote("generate", requests=[], timeout=120)
        time.sleep(1)  # generation is under way
        t0 = time.monotonic()
        assert ray_get(actor.health.remote(5), 20, "health while generating") is True
        assert ray_get(actor.pid.remote(), 20, "pid while generating") > 0
        assert ray_get(actor.process_ids.remote(), 20, "process ids while generating") == []
        ray_get(actor.shutdown.remote(), 20, "shutdown while generating")
        if express:
            try:
                assert busy.result(20) == "stopped"
            except ExpressPeerLost:
                pass  # hung up on by the shutdown: also an answer at once
        else:
            assert ray_get(busy, 20, "the generate call") == "stopped"
        assert time.monotonic() - t0 < 60  # not the 120 s of the generate call
    finally:
        ray.kill(actor)


@pytest.mark.slow
def test_steps_whose_samples_were_all_left_out_skip_their_update_and_the_run_goes_on(tmp_path):
    """A reward component with on_error: skip that fails on every sample leaves nothing to train on: each such step
    says so and makes no update (the unchanged weights are published, one version per step as always), and the run
    finishes (before, it ended at step 1)."""
    rewards = "rewards=[{name: down, fn: 'tests.loop.flaky_rewards:always_raises', on_error: skip}]"
    p = run_train(tmp_path / "run", "run.num_steps=2", rewards, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/reward_excluded_samples"] == 16 and r["rollout/num_samples"] == 0
        assert r["reward/down/errors"] == 16 and "train/loss" not in r and r["sync/version"] == r["step"] + 1
    said = [ln for ln in p.stdout.splitlines() if "0 sample(s) left, too few for this layout" in ln]
    assert len(said) == 2 and all("no update this step; the unchanged weights are published" in ln for ln in said)
