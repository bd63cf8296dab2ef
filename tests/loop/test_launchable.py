"""The production layouts load and are launchable (multi-node engines, colocated engines with TP > 1, colocated
layouts over several nodes); what still cannot work is refused when the recipe loads, by name (before, it was refused
only after the run had written its output directory, and a dry run accepted it)."""

import pytest

from beamrl.recipe import RecipeError, load_recipe


@pytest.mark.parametrize("name,overrides", [
    ("grpo_dapo_math", []),  # two TP16 engines, each spanning two nodes
    ("grpo_dapo_math_b200", []),
    # colocated engines of TP8 on one node
    ("grpo_dapo_math", ["cluster.num_nodes=1", "placement.mode=colocated", "placement.off_policy_steps=0",
                        "sync.transport=colocated", "trainer.num_gpus=8", "trainer.ep=8", "rollout.num_engines=1",
                        "rollout.engine_tp=8", "trainer.global_batch_size=256"]),
])
def test_production_layouts_are_launchable(name, overrides):
    load_recipe(name, overrides)


def test_colocated_engines_on_several_nodes_are_launchable():
    """Colocated CUDA-IPC buckets come from the trainer rank on each engine rank's GPU (every node ships its own),
    so a colocated layout over several nodes is launched, and each engine's TP ranks are matched to trainer ranks."""
    from beamrl.loop.weight_update import rank_colocations
    from beamrl.recipe.layout import placement_of

    r = load_recipe("grpo_dapo_math", ["placement.mode=colocated", "placement.off_policy_steps=0",
                                       "sync.transport=colocated", "trainer.num_gpus=96", "trainer.ep=32",
                                       "trainer.global_batch_size=96", "rollout.prompts_per_step=24",
                                       "rollout.num_engines=12", "rollout.engine_tp=8"])
    colocations = rank_colocations(placement_of(r), r.sync.transport)
    assert colocations == tuple(tuple(range(8 * e, 8 * e + 8)) for e in range(12))


def test_cpu_engine_spanning_nodes_needs_a_transport_over_http(tmp_path):
    overrides = ["rollout.engine=sglang", "cluster.num_nodes=2", "trainer.num_gpus=2", "rollout.engine_tp=2",
                 "trainer.global_batch_size=64", "trainer.micro_batch_size=32"]
    with pytest.raises(RecipeError) as e:
        load_recipe("quickstart", overrides)
    assert e.value.path == "sync.transport"
    load_recipe("quickstart", [*overrides, "sync.transport=disk"])
