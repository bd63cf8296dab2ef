"""A multi-node SGLang engine as the loop starts it: the real CPU engine of TP2 over two simulated nodes of a local
Ray cluster (two server processes, gloo), one actor per node on its placement-group bundle, started in two
phases. API traffic goes to the leader; the follower is watched; a dead follower is named; shutdown leaves no
process behind."""

import os
import signal
import time

import psutil
import pytest
import torch

from beamrl.cluster.placement import plan_placement
from beamrl.cluster.ray_groups import PlacementGroups
from beamrl.cluster.ray_start import start_rehearsal_cluster
from beamrl.loop.groups import EngineGroup
from beamrl.loop.ray_utils import ActorCallError, ray_get
from beamrl.loop.setup import node_factories
from beamrl.models.beam import preset
from beamrl.protocols.rollout import GenerateRequest, SamplingParams
from beamrl.rollout.config import RolloutConfig
from beamrl.rollout.engines import EngineLaunch
from beamrl.trainer.megatron.config import ParallelConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory, ray_temp_dir):
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict

    ckpt = tmp_path_factory.mktemp("ckpt")
    cfg = preset("tiny")
    save_checkpoint(cfg, random_state_dict(cfg, 3, torch.bfloat16), ckpt)
    cluster = start_rehearsal_cluster(2, 1, ray_temp_dir)
    # An engines-only plan: one SGLang engine of TP2 on two nodes of one slot each.
    plan = plan_placement(device="cpu", num_nodes=2, gpus_per_node=1, trainer=ParallelConfig(), trainer_gpus=0,
                          engine="sglang", num_engines=1, engine_tp=2, mode="disaggregated")
    groups = PlacementGroups(plan, timeout=120, log=lambda *_: None)
    rollout = RolloutConfig(engine="sglang", engine_tp=2, max_new_tokens=4, n_samples_per_prompt=1,
                            prompts_per_step=1)
    launch = EngineLaunch(checkpoint=str(ckpt), dtype="float32", device="cpu", seed=5, name="sglang-0",
                          start_timeout=600, return_routed_experts=True, api_key="per-run-secret")
    (e,) = plan.engines
    options = [[groups.actor_options(part.slots[0], 1.0) for part in e.nodes]]
    group = EngineGroup([node_factories(rollout, launch, e, groups)], 600, options)
    yield group, groups
    group.shutdown()
    groups.remove()
    cluster.shutdown()


def _request():
    return [[GenerateRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=4), return_routed_experts=True)]]


def test_leader_serves_the_whole_engine(engine):
    group, groups = engine
    assert group.tp_sizes == [2] and group.rank_offsets == [1] and group.sync_world_size == 3
    assert len(group.followers[0]) == 1
    ((res,),) = group.generate(_request(), 120)
    assert 1 <= len(res.output_ids) <= 4 and res.routed_experts.shape[1:] == (6, 4)
    assert group.health(30) == [True]
    # each node process runs on its own Ray node, as placed
    leader, follower = group.nodes[0]
    assert ray_get(leader.call.remote("health", 30), 60, "leader") and ray_get(follower.health.remote(30), 60, "f")
    # only the leader serves the API; its server refuses a request without the run's key
    import requests

    url = ray_get(leader.call.remote("__getattribute__", "url"), 60, "url")
    assert requests.post(url + "/generate", json={"input_ids": [1, 2]}, timeout=30).status_code == 401


def test_a_dead_follower_is_named_and_shutdown_leaves_nothing(engine):
    group, _ = engine
    leader_pids = ray_get(group.actors[0].process_ids.remote(), 60, "leader pids")
    (follower_pid,) = ray_get(group.followers[0][0].process_ids.remote(), 60, "follower pids")
    os.killpg(follower_pid, signal.SIGKILL)
    assert group.health(30) == [False]
    t0 = time.time()
    with pytest.raises(ActorCallError, match=r"sglang-0's follower node rank\(s\) \[1\] are not alive"):
        group.generate(_request(), 60)
    assert time.time() - t0 < 200
    group.shutdown()
    time.sleep(1)
    assert not [p for p in leader_pids + [follower_pid] if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
