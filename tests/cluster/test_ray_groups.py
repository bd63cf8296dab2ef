"""The launcher's placement on a real multi-node Ray cluster started on this machine (`start_rehearsal_cluster`,
the function `beamrl train` uses for a CPU recipe with several nodes): six simulated nodes of two worker slots,
shared by the whole module. For several layouts, work scheduled with the launcher's own actor options runs on the
Ray node the plan says: every trainer TP group on one node, every engine on its own nodes."""

import shutil
import tempfile
from pathlib import Path

import pytest
import ray

from beamrl.cluster.placement import PlacementError, Slot
from beamrl.cluster.ray_groups import PlacementGroups
from beamrl.cluster.ray_start import NODE_RESOURCE_PREFIX, start_rehearsal_cluster
from beamrl.environ import scoped_environ
from beamrl.recipe import load_recipe
from beamrl.recipe.layout import placement_of

pytestmark = pytest.mark.slow

NODES, SLOTS = 6, 2
CPU = ["cluster.device=cpu", f"cluster.gpus_per_node={SLOTS}"]


@pytest.fixture(scope="module")
def cluster(ray_temp_dir):
    # Started as on a machine where Ray never ran: no default Ray folder (Ray's `Cluster.add_node` writes into it).
    no_ray_yet = Path(tempfile.mkdtemp(prefix="beamrl-noray-", dir="/tmp"))  # short: Ray's socket paths
    try:
        with scoped_environ({"RAY_TMPDIR": str(no_ray_yet)}):
            c = start_rehearsal_cluster(NODES, SLOTS, ray_temp_dir)
        yield c
        with scoped_environ({"RAY_TMPDIR": str(no_ray_yet)}):  # Ray's shutdown deletes the default address file
            c.shutdown()
    finally:
        shutil.rmtree(no_ray_yet, ignore_errors=True)


def test_the_cluster_leaves_rays_default_address_file_as_it_found_it(cluster):
    """Ray wrote the rehearsal's address to its default folder's file; with no file there before, none is left (a
    `ray.init()` elsewhere on the machine would join the rehearsal, or a dead address after it)."""
    assert cluster.address_file.parent.is_dir() and cluster.previous_address is None
    assert not cluster.address_file.exists()


@ray.remote(num_cpus=0)
def where() -> str:
    return ray.get_runtime_context().get_node_id()


def _identity() -> dict[str, int]:
    """Ray node id -> the simulated node's index (its identity resource)."""
    return {n["NodeID"]: int(k[len(NODE_RESOURCE_PREFIX):]) for n in ray.nodes() if n.get("Alive")
            for k in n["Resources"] if k.startswith(NODE_RESOURCE_PREFIX)}


def _place(plan):
    """Place `plan`, run a task with each trainer rank's and each engine process's actor options, and return
    slot -> the Ray node the work ran on (every slot of an engine part: the node of its process)."""
    groups = PlacementGroups(plan, timeout=120, log=lambda *_: None)
    try:
        ran = {}
        refs = {t.slot: where.options(**groups.actor_options(t.slot, 0.6)).remote() for t in plan.trainer}
        parts = {part: where.options(**groups.actor_options(part.slots[0], 0.2)).remote()
                 for part in plan.engine_nodes()}
        ran.update(zip(refs, ray.get(list(refs.values()), timeout=300)))
        for part, node in zip(parts, ray.get(list(parts.values()), timeout=300)):
            for s in part.slots:
                assert ran.setdefault(s, node) == node  # colocated: the trainer rank of this slot ran there too
        return ran, groups
    finally:
        groups.remove()


def _check(plan, ran, groups):
    plan.check(lambda s: ran[s])  # TP groups on one node, engines on their own nodes, as Ray really placed them
    ident = _identity()
    for s, node in ran.items():
        assert node == groups.bundles[s].node_id
    # one plan node = one Ray node, in the order of the simulated nodes
    per_plan_node = [{ran[s] for s in ran if s.node == n} for n in range(plan.num_nodes)]
    used = [n for n in per_plan_node if n]
    assert all(len(n) == 1 for n in used) and len({next(iter(n)) for n in used}) == len(used)
    order = [ident[next(iter(n))] for n in used]
    assert order == sorted(order)


def test_scaled_down_grpo_dapo_math(cluster):
    """The production shape on 6 x 2: the trainer's TP groups one node each with EP across all trainer nodes,
    two engines of TP4 that span two whole nodes each (their leaders on plan nodes 2 and 4)."""
    r = load_recipe("grpo_dapo_math", CPU + [
        f"cluster.num_nodes={NODES}", "trainer.num_gpus=4", "trainer.tp=2", "trainer.ep=4", "rollout.engine_tp=4",
        "trainer.use_fused_kernels=false", "trainer.optimizer_offload_fraction=0", "rollout.num_engines=2",
        "rollout.swa_full_tokens_ratio=0.8"])  # (the CPU engine sizes its own pool: the GPU ratio is refused)
    plan = placement_of(r)
    assert [[p.node for p in e.nodes] for e in plan.engines] == [[2, 3], [4, 5]]
    ran, groups = _place(plan)
    _check(plan, ran, groups)
    trainer_nodes = {ran[t.slot] for t in plan.trainer}
    engine_nodes = [{ran[s] for s in e.slots} for e in plan.engines]
    assert len(trainer_nodes) == 2 and all(len(n) == 2 for n in engine_nodes)
    assert not trainer_nodes & engine_nodes[0] and not trainer_nodes & engine_nodes[1]
    assert not engine_nodes[0] & engine_nodes[1]


def test_colocated_engines_on_trainer_slices(cluster):
    """Colocated on 2 x 2 with a KL reference: each TP2 engine on the node of the trainer TP group it shares."""
    r = load_recipe("quickstart", CPU + [
        "cluster.num_nodes=2", "trainer.num_gpus=4", "trainer.tp=2", "trainer.sp=true", "rollout.engine=sglang",
        "rollout.engine_tp=2", "rollout.num_engines=2", "trainer.global_batch_size=32", "trainer.micro_batch_size=16",
        "algorithm.kl.reference=true", "algorithm.kl.coef=0.01"])
    plan = placement_of(r)
    ran, groups = _place(plan)
    _check(plan, ran, groups)
    for e in plan.engines:
        assert {ran[s] for s in e.slots} == {ran[plan.trainer[t].slot] for t in e.shares_with_trainer}


def test_fractional_engines_and_a_shared_node(cluster):
    """3 trainer ranks and a TP1 engine on 2 x 2: the engine takes the free slot of the trainer's second node; then
    two TP1 engines together on one node after a two-node trainer."""
    base = CPU + ["rollout.engine=sglang", "placement.mode=disaggregated", "sync.transport=distributed"]
    plan = placement_of(load_recipe("quickstart", base + ["cluster.num_nodes=2", "trainer.num_gpus=3",
                                                          "trainer.global_batch_size=63", "rollout.prompts_per_step=9",
                                                          "rollout.n_samples_per_prompt=7",
                                                          "trainer.micro_batch_size=21"]))
    assert plan.engines[0].slots == (Slot(1, 1),)
    ran, groups = _place(plan)
    _check(plan, ran, groups)
    assert ran[Slot(1, 1)] == ran[Slot(1, 0)] != ran[Slot(0, 0)]
    plan = placement_of(load_recipe("quickstart", base + ["cluster.num_nodes=3", "trainer.num_gpus=4",
                                                          "rollout.num_engines=2", "trainer.micro_batch_size=16"]))
    ran, groups = _place(plan)
    _check(plan, ran, groups)
    assert ran[plan.engines[0].slots[0]] == ran[plan.engines[1].slots[0]]


def test_a_layout_larger_than_the_cluster_fails_by_name(cluster):
    plan = placement_of(load_recipe("quickstart", CPU + ["cluster.num_nodes=7", "trainer.num_gpus=14",
                                                         "trainer.global_batch_size=56", "trainer.micro_batch_size=4",
                                                         "rollout.num_engines=14", "rollout.prompts_per_step=7"]))
    with pytest.raises(PlacementError, match=r"1 of 7 node placement group\(s\).*cluster.num_nodes"):
        PlacementGroups(plan, timeout=10, log=lambda *_: None)
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] == "PENDING"]
