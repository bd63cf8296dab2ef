"""ParallelConfig: derived DP size and clear errors for layouts that cannot run."""

import pytest

from beamrl.models.beam import preset
from beamrl.trainer.megatron.parallel import ParallelConfig, ParallelConfigError


def test_dp_is_derived_from_the_world():
    assert ParallelConfig().dp(4) == 4
    assert ParallelConfig(tp=2, sp=True).dp(4) == 2
    assert ParallelConfig(tp=2, sp=True, ep=2).dp(2) == 1
    assert ParallelConfig(pp=2, vpp=2).dp(4) == 2 and ParallelConfig(pp=2, vpp=2).num_model_chunks == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=0), "tp=0"),
    (dict(ep=1.5), "ep=1.5"),
    (dict(vpp=2), "needs pp >= 2"),
    (dict(pp=2, vpp=1), "vpp=1"),
    (dict(sp=True), "sp=True needs tp > 1"),
])
def test_invalid_sizes(kwargs, match):
    with pytest.raises(ParallelConfigError, match=match):
        ParallelConfig(**kwargs)


def test_world_and_model_divisibility():
    with pytest.raises(ParallelConfigError, match="not divisible by tp\\*pp"):
        ParallelConfig(tp=2, sp=True).dp(3)
    with pytest.raises(ParallelConfigError, match="etp\\*ep\\*pp"):
        ParallelConfig(ep=4).dp(2)
    with pytest.raises(ParallelConfigError, match="num_hidden_layers=6 must be divisible by pp\\*vpp = 4"):
        ParallelConfig(pp=2, vpp=2).validate(preset("tiny"))
    with pytest.raises(ParallelConfigError, match="sp must be True"):
        ParallelConfig(tp=2).validate(preset("tiny"))
    with pytest.raises(ParallelConfigError, match="ep=3 must divide num_experts"):
        ParallelConfig(ep=3).validate(preset("tiny"))
    ParallelConfig(tp=2, sp=True, ep=2).validate(preset("tiny"))
