"""The trainer section (`TrainerConfig`) and its one set of parallel-layout rules (`ParallelConfig`): derived DP
size and an error naming the field for every layout that cannot run."""

import pytest

from beamrl.config import ConfigError
from beamrl.models.beam import preset
from beamrl.trainer.megatron.config import ParallelConfig, TrainerConfig


def test_dp_is_derived_from_the_world():
    assert ParallelConfig().dp_size(4) == 4
    assert ParallelConfig(tp=2, sp=True).dp_size(4) == 2
    assert ParallelConfig(tp=2, sp=True, ep=2).dp_size(2) == 1
    assert ParallelConfig(pp=2, vpp=2).dp_size(4) == 2 and ParallelConfig(pp=2, vpp=2).num_model_chunks == 2
    t = TrainerConfig(num_gpus=8, tp=2, sp=True, ep=4, global_batch_size=16, lr=1e-6)
    assert t.dp == 4 and t.parallel == ParallelConfig(tp=2, sp=True, ep=4)
    assert t.to_dict() == {"tp": 2, "sp": True, "ep": 4, "etp": 1, "pp": 1, "vpp": None}  # checkpoint metadata


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=0), "tp"),
    (dict(ep=1.5), "ep"),
    (dict(vpp=2), "needs pp >= 2"),
    (dict(pp=2, vpp=1), "vpp"),
    (dict(sp=True), "sp=True: sequence parallelism"),
    (dict(etp=2), "etp=2: Beam's trainer supports only 1"),
    (dict(tp=2, ep=2), "sp=False: expert parallelism with tp > 1 requires sp"),
])
def test_invalid_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_world_rules_name_the_field():
    with pytest.raises(ConfigError, match="must be a multiple of tp \\* pp") as e:
        ParallelConfig(tp=2, sp=True).dp_size(3)
    assert e.value.path == "num_gpus"
    with pytest.raises(ConfigError, match="etp\\*ep\\*pp") as e:
        ParallelConfig(ep=4).dp_size(2)
    assert e.value.path == "ep"
    with pytest.raises(ValueError, match="global_batch_size=6: must be a multiple of micro_batch_size \\* dp"):
        TrainerConfig(num_gpus=4, global_batch_size=6, lr=1e-6)


@pytest.mark.parametrize("settings, changes, path, words", [
    (dict(tp=2), {}, "sp", "MoE model with tp > 1"),
    (dict(tp=4, sp=True), {}, "tp", "head counts"),
    (dict(tp=2, sp=True), {"vocab_size": 511}, "tp", "vocab_size=511"),
    (dict(tp=2, sp=True), {"intermediate_size": 129}, "tp", "intermediate_size=129"),
    (dict(ep=3), {}, "ep", "num_experts=16"),
    (dict(ep=2), {"mlp_layer_types": ["dense"] * 6}, "ep", "no MoE layers"),
    (dict(pp=4), {}, "pp", "num_hidden_layers=6"),
    (dict(pp=2, vpp=2), {}, "vpp", "6 / 2 = 3"),
])
def test_model_rules_name_the_field(settings, changes, path, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**settings).check_model(preset("tiny").replace(**changes))
    assert e.value.path == path and words in str(e.value)
    ParallelConfig(tp=2, sp=True, ep=2).check_model(preset("tiny"))


def test_offload_needs_the_distributed_optimizer():
    with pytest.raises(ValueError, match="optimizer_offload_fraction=0.5: CPU offload"):
        TrainerConfig(num_gpus=1, global_batch_size=1, lr=1e-6, distributed_optimizer=False,
                      optimizer_offload_fraction=0.5)


def test_stage_layers_plain_and_interleaved():
    assert ParallelConfig(pp=2).stage_layers(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # interleaved: rank p holds chunks p and p + pp
    assert ParallelConfig(pp=2, vpp=2).stage_layers(8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sorted(sum(ParallelConfig(pp=4).stage_layers(52), [])) == list(range(52))
    assert ParallelConfig(tp=2, sp=True, ep=4, pp=2).expert_dp_size(16) == 2
