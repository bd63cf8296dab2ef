"""The sync-time model for a recipe's layout, checked against hand counts from the config fields, and printed by
`--dry-run` for the production recipe (and a B200-sized variant of it)."""

import pytest

from beamrl.models.beam import preset
from beamrl.recipe import load_recipe
from beamrl.recipe.dry_run import dry_run
from beamrl.recipe.sync_time import RATES, TARGET_S, estimate_sync_time, model_bytes


def _bytes_501b():
    c = preset("beam-501b")
    router = bias = 49 * c.num_experts
    router *= c.hidden_size
    experts = 49 * c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size * 2
    return 2 * (c.num_parameters() - router - bias) + 4 * (router + bias), experts


def test_501b_bytes_are_the_weight_table_at_bf16_with_an_fp32_router():
    total, experts = model_bytes(preset("beam-501b"), "bfloat16")
    assert (total, experts) == _bytes_501b()
    assert 1.0e12 < total < 1.01e12


def test_production_recipe_as_built_and_per_source_rank_projections():
    r = load_recipe("grpo_dapo_math")
    e = estimate_sync_time(r, preset("beam-501b"))
    total, experts = _bytes_501b()
    rt = RATES["h200"]
    # as built: experts all-gathered over EP64 across 8 nodes, dense over TP8 in a node, one broadcast stream
    assert e.gather_s == pytest.approx(experts * 63 / 64 / (rt.inter_node * 1e9)
                                       + (total - experts) * 7 / 8 / (rt.intra_node * 1e9))
    assert e.transfer_s == pytest.approx(total / (rt.inter_node * 1e9))
    assert e.as_built_s > 40  # honest: the rank-0 design is an order of magnitude off the target
    # per source rank: each engine node takes the full model through its 8 GPUs' network shares
    assert e.per_source_s == pytest.approx(total / (8 * rt.inter_node * 1e9) + e.pack_s / 64 + e.load_s)
    assert e.per_source_s <= TARGET_S
    assert e.buckets == -(-total // (512 << 20))


def test_dry_run_prints_the_projection_for_the_production_recipes():
    for overrides, gpu in (([], "h200"), (["cluster.gpu_type=b200", "rollout.engine_tp=8", "rollout.num_engines=4"],
                                          "b200")):
        r = load_recipe("grpo_dapo_math", overrides)
        e = estimate_sync_time(r, preset("beam-501b"))
        report = dry_run(r, checks=False).report
        assert f"projected, as built (gathered on trainer rank 0, one stream): {e.as_built_s:.1f} s" in report
        assert f"projected, per-source-rank broadcasts: {e.per_source_s:.1f} s (within the 5 s target" in report
        assert f"per-GPU rates ({gpu}): colocated {RATES[gpu].colocated:g}" in report


def test_colocated_recipes_use_the_colocated_rate():
    import copy

    from beamrl.recipe import apply_override, validate_recipe
    from tests.recipe.conftest import BASE  # a small valid GPU recipe

    base_raw = copy.deepcopy(BASE)
    for o in ("placement.mode=colocated", "sync.transport=colocated", "rollout.engine_tp=1", "rollout.num_engines=16",
              "trainer.num_gpus=16"):
        apply_override(base_raw, o)
    apply_override(base_raw, "cluster.num_nodes=1")
    apply_override(base_raw, "cluster.gpus_per_node=16")
    r = validate_recipe(base_raw)
    c = preset("tiny")
    total = model_bytes(c, r.model.dtype)[0]
    assert estimate_sync_time(r, c).transfer_s == pytest.approx(total / (RATES["h200"].colocated * 1e9))
    # buckets from every trainer rank (engines of TP > 1, several nodes): first spread to every trainer rank
    for overrides, link in ((["rollout.engine_tp=2", "rollout.num_engines=8"], RATES["h200"].intra_node),
                            (["cluster.num_nodes=2", "cluster.gpus_per_node=8"], RATES["h200"].inter_node)):
        raw = copy.deepcopy(base_raw)
        for o in overrides:
            apply_override(raw, o)
        e = estimate_sync_time(validate_recipe(raw), c)
        assert e.transfer_s == pytest.approx(total / (RATES["h200"].colocated * 1e9) + total / (link * 1e9))
