"""Rehearsals of cluster layouts on one machine (`cluster.device: cpu` with several nodes: a local Ray cluster of
one simulated node per recipe node), end to end with the real SGLang CPU engine and the real Megatron trainer
(gloo), disaggregated, the weights synced over the distributed transport and verified after every step:
- an engine of TP2 spanning two nodes (two server processes) next to a one-rank trainer, one of its node
  processes killed mid-rollout (issue 15: restart, resync, re-issued requests);
- a TP2 trainer on a node of its own, its TP2 engine on the other node, one step off policy (`beamrl train`)."""

import os
import signal

import pytest

from tests.loop.e2e_helpers import (QUICKSTART, SMALL, assert_engine_routes_replayed,
                                     assert_importance_metrics_in_bounds, metrics, run_train)

pytestmark = pytest.mark.slow

# Every step must change the weights (a learning signal from a random policy), or a sync that moved nothing would
# verify as well as one that moved everything.
COMMON = ["rollout.engine=sglang", "model.dtype=bfloat16", "trainer.distributed_optimizer=true",
          "placement.mode=disaggregated", "sync.transport=distributed", "sync.verify=true", "run.num_steps=3",
          "trainer.lr=1.0e-2", "rewards=[{name: digit, fn: 'tests.loop.shaped_rewards:first_digit'}]"]


def _ok(p):
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"


def _synced_and_verified_every_step(rows, versions):
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/weight_version"] for r in rows] == versions
    assert [r["sync/version"] for r in rows] == [1, 2, 3]  # each engine reported the new version after each step
    # the probe check ran after every sync (bf16: the run fails when the mean over the probe's tokens is above 0.5; a
    # stale engine is far above it); the max is reported too
    gaps = [(r["sync/verify_mean_abs_logprob_diff"], r["sync/verify_max_abs_logprob_diff"]) for r in rows]
    assert all(mean < 0.5 and largest < 3.0 for mean, largest in gaps), gaps
    assert all(r["train/grad_norm"] > 0 for r in rows)  # the weights changed every step
    # R3: on the steps sampled with the weights being trained, the engine's logprobs are the trainer's
    on_policy = [r["train_rollout_logprob_abs_diff"] for r in rows if r["rollout/weight_version"] == r["step"]]
    assert on_policy and max(on_policy) < 0.1, on_policy
    assert_engine_routes_replayed(rows)


def test_engine_spanning_two_nodes_survives_a_killed_node_process(tmp_path, monkeypatch, capsys):
    """The spanning engine's follower server process (its node's TP rank) is killed while step 1's requests are in
    flight on the engine: the loop restarts the whole engine (both nodes), resyncs it to version 1 and re-issues
    the lost requests; the run ends with every step's full batch. In process (not `beamrl train`) so the kill
    lands at a known point of the run."""
    from beamrl.loop import run_training
    from beamrl.loop.collect import RolloutCollector
    from beamrl.loop.ray_utils import ray_get
    from beamrl.recipe import load_recipe

    killed: list[int] = []
    start = RolloutCollector.start

    def start_then_kill_the_follower(self, step, version):
        if step != 1:
            return start(self, step, version)
        (follower,) = self.engines.followers[0]
        (pid,) = ray_get(follower.process_ids.remote(), 60, "follower server pid")
        pending = start(self, step, version)  # step 1's requests are in flight on the engine ...
        os.killpg(pid, signal.SIGKILL)  # ... when the follower node's server (and its TP rank) dies
        killed.append(pid)
        return pending

    monkeypatch.setattr(RolloutCollector, "start", start_then_kill_the_follower)
    # health checks every 5 s while the rollout waits: the dead node is found soon after the kill
    overrides = [f"run.output_dir={tmp_path / 'run'}", *SMALL, *COMMON, "cluster.num_nodes=3",
                 "cluster.gpus_per_node=1", "rollout.engine_tp=2", "rollout.health_check_interval_s=5"]
    out_dir = run_training(load_recipe(QUICKSTART, overrides))
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert "rehearsal: local Ray cluster of 3 simulated node(s) x 1 worker slot(s)" in out
    assert "node 0 slots 0: trainer ranks 0" in out
    assert "node 1 slots 0: engine sglang-0 node rank 0/2 (leader: API) TP ranks 0, weight-sync ranks 1" in out
    assert "node 2 slots 0: engine sglang-0 node rank 1/2 TP ranks 1, weight-sync ranks 2" in out
    assert "1 sglang engine(s) (2 node process(es)) ready" in out
    assert len(killed) == 1
    assert "restarted in" in out and "sglang-0 (node pids" in out, out[-3000:]
    rows = metrics(out_dir)
    assert [r["engine/restarts"] for r in rows] == [0, 1, 0]
    for r in rows:  # every step trained on its full batch: the lost requests were re-issued
        assert r["rollout/num_samples"] == 16 and r["rollout/aborted_groups"] == 0, r
    # the restarted engine was resynced: it served step 1 at version 1 (and the probe check passed after it)
    _synced_and_verified_every_step(rows, [0, 1, 2])


def test_tp2_trainer_on_its_own_node_one_step_off(tmp_path):
    p = run_train(tmp_path / "run", *COMMON, "cluster.num_nodes=2", "cluster.gpus_per_node=2", "trainer.num_gpus=2",
                  "trainer.tp=2", "trainer.sp=true", "rollout.engine_tp=2", "placement.off_policy_steps=1",
                  "algorithm.importance.mode=tis", "algorithm.importance.cap=2.0", timeout=1500)
    _ok(p)
    assert "node 0 slots 0-1: trainer ranks 0-1 (tp 0-1, dp 0, pp 0; ep 0, expert-dp 0-1)" in p.stdout
    assert "node 1 slots 0-1: engine sglang-0 TP ranks 0-1, weight-sync ranks 1-2" in p.stdout
    # actors on two nodes: every call goes through Ray (docs/express-calls.md)
    assert ("actor calls: through Ray (express calls need every actor on the driver's node; these run on 2 node(s)"
            in p.stdout)
    rows = metrics(tmp_path / "run")
    # one step off: step k+1 is generated with version k while step k trains
    _synced_and_verified_every_step(rows, [0, 0, 1])
    assert_importance_metrics_in_bounds(rows, cap=2.0)
