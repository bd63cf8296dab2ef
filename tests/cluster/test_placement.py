"""The placement plan (pure): Megatron's rank coordinates, the production layout, the rules that name a field, and
the invariant check the launcher runs against where Ray really put things."""

import pytest

from beamrl.cluster.placement import PlacementError, Slot, sync_rank_offsets
from beamrl.recipe import RecipeError, load_recipe
from beamrl.recipe.layout import placement_of
from beamrl.trainer.megatron.config import ParallelConfig


@pytest.mark.parametrize("sizes,num_gpus", [
    (dict(tp=2, sp=True, ep=4), 8),
    (dict(tp=8, sp=True, ep=64), 64),
    (dict(tp=2, sp=True, ep=2, pp=2), 16),
    (dict(tp=4, sp=True, ep=8, pp=2, vpp=2), 32),
    (dict(tp=1, ep=4), 8),
])
def test_coordinates_are_megatrons(sizes, num_gpus):
    """Groups built from `ParallelConfig.coordinates` equal megatron-core's own (`RankGenerator`, the order
    `initialize_model_parallel` uses): the plan numbers ranks exactly as Megatron will group them."""
    from megatron.core.parallel_state import RankGenerator

    p = ParallelConfig(**sizes)
    dp, edp = p.dp_size(num_gpus), p.expert_dp_size(num_gpus)
    dense = RankGenerator(tp=p.tp, ep=1, dp=dp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=p.etp, ep=p.ep, dp=edp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    coords = [p.coordinates(r, num_gpus) for r in range(num_gpus)]

    def groups(key):
        out = {}
        for c in coords:
            out.setdefault(key(c), []).append(c.rank)
        return sorted(out.values())

    assert groups(lambda c: c.tp_group) == sorted(dense.get_ranks("tp"))
    assert groups(lambda c: (c.pp, c.tp)) == sorted(dense.get_ranks("dp"))
    assert groups(lambda c: (c.tp, c.dp)) == sorted(dense.get_ranks("pp"))
    assert groups(lambda c: c.expert_tp_group) == sorted(expert.get_ranks("tp"))
    assert groups(lambda c: (c.pp, c.expert_dp, c.etp)) == sorted(expert.get_ranks("ep"))
    assert groups(lambda c: (c.pp, c.ep, c.etp)) == sorted(expert.get_ranks("dp"))
    # the coordinate values themselves are the ranks inside those groups
    for g in dense.get_ranks("tp"):
        assert [coords[r].tp for r in g] == list(range(p.tp))
    for g in expert.get_ranks("ep"):
        assert [coords[r].ep for r in g] == list(range(p.ep))


def test_production_plan():
    """grpo_dapo_math: 8 trainer nodes (one TP8 group each, EP64 over all of them), then two TP16 engines of two
    whole nodes each, their leaders on nodes 8 and 10; weight-sync ranks 1-16 and 17-32 (world 33)."""
    plan = placement_of(load_recipe("grpo_dapo_math"))
    assert (plan.num_nodes, plan.slots_per_node, len(plan.trainer)) == (12, 8, 64)
    for t in plan.trainer:
        assert t.slot == Slot(t.rank // 8, t.rank % 8)
        assert (t.coords.tp, t.coords.dp, t.coords.ep, t.coords.expert_dp) == (t.rank % 8, t.rank // 8, t.rank, 0)
    assert [[(n.node, n.node_rank, n.tp_ranks) for n in e.nodes] for e in plan.engines] == [
        [(8, 0, tuple(range(8))), (9, 1, tuple(range(8, 16)))],
        [(10, 0, tuple(range(8))), (11, 1, tuple(range(8, 16)))]]
    assert all(n.base_gpu == 0 for n in plan.engine_nodes())
    assert [e.sync_rank_offset for e in plan.engines] == [1, 17] and plan.sync_world_size == 33
    plan.check()


def test_update_group_ranks_match_the_distributed_transport():
    """The offsets the plan and the engine group report are the ones the distributed transport joins engines at
    (world = engine GPUs + 1; offset = GPUs of the engines before + 1), also for engines that span nodes."""
    from beamrl.models.beam import preset
    from beamrl.sync.transports.distributed import DistributedTransport
    from tests.rollout.fake_engine import FakeEngine

    class Engine(FakeEngine):  # the fake engine with the TP size of a (multi-node) engine's leader
        def __init__(self, tp):
            super().__init__(preset("tiny"))
            self._tp = tp

        tp_size = property(lambda self: self._tp)

    for tps in ([16, 16], [1, 2, 4], [8]):
        t = DistributedTransport([Engine(tp) for tp in tps])
        assert sync_rank_offsets(tps) == t.rank_offsets()
        assert 1 + sum(tps) == t.world_size
    plan = placement_of(load_recipe("grpo_dapo_math"))
    assert [e.sync_rank_offset for e in plan.engines] == sync_rank_offsets([e.tp for e in plan.engines])


def test_colocated_engines_share_trainer_slices():
    r = load_recipe("grpo_dapo_math", ["placement.mode=colocated", "placement.off_policy_steps=0",
                                       "sync.transport=colocated", "trainer.num_gpus=96", "trainer.ep=32",
                                       "trainer.global_batch_size=96", "rollout.prompts_per_step=24",
                                       "rollout.num_engines=12", "rollout.engine_tp=8", "algorithm.kl.reference=true"])
    plan = placement_of(r)
    assert plan.reference
    for e in plan.engines:
        assert e.shares_with_trainer == tuple(range(8 * e.index, 8 * e.index + 8))
        assert e.slots == tuple(plan.trainer[r].slot for r in e.shares_with_trainer)
        assert e.nnodes == 1 and e.nodes[0].node == e.index


@pytest.mark.parametrize("overrides,words", [
    # TP8 on 4-GPU nodes: a TP group larger than a node
    (["cluster.gpus_per_node=4", "cluster.num_nodes=24"], "ranks 0-7 would span nodes [0, 1]"),
    # TP4 on 6-GPU nodes: the second group takes GPUs 4-5 of node 0 and 0-1 of node 1
    (["cluster.gpus_per_node=6", "cluster.num_nodes=16", "trainer.tp=4", "rollout.engine_tp=2",
      "rollout.num_engines=16"], "ranks 4-7 would span nodes [0, 1]"),
])
def test_tp_groups_stay_inside_a_node(overrides, words):
    with pytest.raises(RecipeError) as e:
        placement_of(load_recipe("grpo_dapo_math", overrides))
    assert e.value.path == "trainer.tp" and words in str(e.value)


def test_engines_stay_inside_a_node_or_take_whole_nodes():
    """Engines after the trainer's GPUs: a fraction of one node, or whole nodes. (The recipe's GPU-count rules
    already make every recipe align; the plan still refuses numbers that do not.)"""
    from beamrl.cluster.placement import plan_placement
    from beamrl.config import ConfigError

    def plan(trainer_gpus, engine_tp, num_engines, gpn=4, nodes=3):
        return plan_placement(device="cuda", num_nodes=nodes, gpus_per_node=gpn, trainer=ParallelConfig(),
                              trainer_gpus=trainer_gpus, engine="sglang", num_engines=num_engines,
                              engine_tp=engine_tp, mode="disaggregated")

    assert [e.slots for e in plan(6, 2, 3).engines] == [(Slot(1, 2), Slot(1, 3)), (Slot(2, 0), Slot(2, 1)),
                                                        (Slot(2, 2), Slot(2, 3))]
    assert [[p.node for p in e.nodes] for e in plan(4, 8, 1).engines] == [[1, 2]]
    with pytest.raises(ConfigError, match="would straddle nodes 0 and 1") as e:
        plan(3, 2, 4, nodes=3)
    assert e.value.path == "trainer.num_gpus"
    with pytest.raises(ConfigError, match="needs whole nodes, but would start at GPU 2 of node 0") as e:
        plan(2, 8, 1)
    assert e.value.path == "trainer.num_gpus"


def test_check_rejects_what_ray_might_do():
    """The launcher checks the nodes Ray really used with the same rules (here: node maps that break them)."""
    plan = placement_of(load_recipe("grpo_dapo_math"))
    plan.check(lambda s: f"host-{s.node}")
    with pytest.raises(PlacementError, match="TP group of ranks"):  # node 0's last GPU elsewhere
        plan.check(lambda s: "odd" if s == Slot(0, 7) else f"host-{s.node}")
    with pytest.raises(PlacementError, match="two of its node ranks share a node"):  # both halves of an engine
        plan.check(lambda s: "host-8" if s.node == 9 else f"host-{s.node}")
    with pytest.raises(PlacementError, match="shares node"):  # an engine node that also holds trainer ranks
        plan.check(lambda s: "host-7" if s.node == 8 else f"host-{s.node}")


def test_dry_run_prints_the_plan_of_the_launcher(capsys):
    """`--dry-run` prints exactly the text of the plan the launcher places (the same function)."""
    from beamrl.cli import main
    from beamrl.cluster.report import format_placement

    assert main(["train", "recipes/grpo_dapo_math.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan_text = format_placement(placement_of(load_recipe("recipes/grpo_dapo_math.yaml")))
    assert plan_text in out
    assert "placement (12 node(s) x 8 GPUs; node -> GPUs -> role):" in out
    for n in range(8):  # the 96-GPU plan, node by node
        assert (f"node {n} GPUs 0-7: trainer ranks {8 * n}-{8 * n + 7} (tp 0-7, dp {n}, pp 0; ep {8 * n}-{8 * n + 7}, "
                "expert-dp 0)") in out
    for k in range(2):
        assert (f"node {8 + 2 * k} GPUs 0-7: engine sglang-{k} node rank 0/2 (leader: API) TP ranks 0-7, weight-sync "
                f"ranks {1 + 16 * k}-{8 + 16 * k}") in out
        assert (f"node {9 + 2 * k} GPUs 0-7: engine sglang-{k} node rank 1/2 TP ranks 8-15, weight-sync ranks "
                f"{9 + 16 * k}-{16 + 16 * k}") in out
    assert "weight-update group: world 33 = trainer rank 0 (update-group rank 0) + 32 engine GPUs" in out
