"""BeamConfig -> TransformerConfig bridge; it refuses a layout the Beam config cannot take (`check_model`)."""

import pytest
import torch

from beamrl.models.beam import preset

from ._world import world1

# In-process Megatron on CPU: the compatibility layer for this module only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("megatron_cpu_shim")


@pytest.fixture(scope="module", autouse=True)
def _world():
    world1()


def test_beam_fields_are_carried():
    from beamrl.trainer.megatron.model import beam_transformer_config
    from beamrl.trainer.megatron.config import ParallelConfig

    c = preset("tiny")
    t = beam_transformer_config(c, ParallelConfig(), dtype=torch.float32)
    assert t.num_layers == 6 and t.num_query_groups == 2 and t.kv_channels == 16
    assert t.window_size == (c.sliding_window - 1, 0)
    assert t.window_attn_skip_freq == [1, 1, 0, 1, 1, 0]  # 1 = sliding layer
    assert t.no_rope_freq == [0, 0, 1, 0, 0, 1]  # full layers are NoPE
    assert t.moe_layer_freq == [0, 1, 1, 1, 1, 1]
    assert t.moe_router_topk == 4 and t.moe_router_num_groups == 4 and t.moe_router_group_topk == 2
    assert t.moe_router_enable_expert_bias is False  # the bias is a frozen FP32 buffer (synced as a weight)
    assert t.beam is c and t.kernel_backend == "eager" and t.attention_backend_name == "eager"
    assert beam_transformer_config(c, dtype=torch.float32, use_fused_kernels=True).kernel_backend == "triton"
    full = beam_transformer_config(c, dtype=torch.float32, recompute="full")
    assert full.recompute_granularity == "full"


@pytest.mark.parametrize("settings, field", [
    (dict(tp=2, sp=False), "sp"), (dict(etp=2), "etp"), (dict(tp=4, sp=True), "tp"), (dict(ep=3), "ep"),
    (dict(pp=4), "pp"), (dict(pp=2, vpp=2), "vpp"),
])
def test_bad_layouts_name_the_field(settings, field):
    from pydantic import ValidationError

    from beamrl.config import ConfigError
    from beamrl.trainer.megatron.config import ParallelConfig
    from beamrl.trainer.megatron.model import beam_transformer_config

    try:
        parallel = ParallelConfig(**settings)
    except ValidationError as e:  # a rule of the sizes alone
        assert e.errors()[0]["ctx"]["error"].path == field
        return
    with pytest.raises(ConfigError) as e:  # a rule of the model
        beam_transformer_config(preset("tiny"), parallel, dtype=torch.float32)
    assert e.value.path == field
