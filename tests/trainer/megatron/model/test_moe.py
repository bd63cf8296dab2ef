"""BeamExperts' EP partial sums: eager per-expert path == the combine of `ops.grouped_experts` (float32), and the
grouped-GEMM path (fused kernels, `torch._grouped_mm`, here on CPU) within its documented BF16 deviation."""

import pytest
import torch

from beamrl.kernels import ops
from beamrl.models.beam import preset

from ._world import world1

# In-process Megatron on CPU: the compatibility layer for this module only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("megatron_cpu_shim")


@pytest.fixture(scope="module")
def experts_factory():
    world1()
    from beamrl.trainer.megatron.model import beam_transformer_config
    from beamrl.trainer.megatron.model.moe import BeamExperts

    def make(dtype, fused, num_local, first):
        cfg = beam_transformer_config(preset("tiny"), dtype=dtype)
        cfg.use_fused_kernels = fused
        torch.manual_seed(0)
        return BeamExperts(cfg, num_local, first)

    return make


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def test_ep_halves_sum_to_the_full_combine(experts_factory):
    c = preset("tiny")
    full = experts_factory(torch.float32, False, c.num_experts, 0)
    half = c.num_experts // 2
    lo, hi = experts_factory(torch.float32, False, half, 0), experts_factory(torch.float32, False, half, half)
    with torch.no_grad():
        lo.gate_up_weight.copy_(full.gate_up_weight[:half]); lo.down_weight.copy_(full.down_weight[:half])
        hi.gate_up_weight.copy_(full.gate_up_weight[half:]); hi.down_weight.copy_(full.down_weight[half:])
    x = torch.randn(24, c.hidden_size)
    ids, w = _routing(24, c.num_experts, c.num_experts_per_tok, 1)
    want = ops.grouped_experts(x, ids, w, full.gate_up_weight, full.down_weight, c.routed_scaling_factor)
    got = (lo.partial_fp32(x, ids, w) + hi.partial_fp32(x, ids, w)) * c.routed_scaling_factor
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_grouped_partial_matches_eager_in_bf16(experts_factory):
    c = preset("tiny")
    eager = experts_factory(torch.bfloat16, False, 8, 8)
    fused = experts_factory(torch.bfloat16, True, 8, 8)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(40, c.hidden_size).to(torch.bfloat16)
    ids, w = _routing(40, c.num_experts, c.num_experts_per_tok, 2)
    a, b = eager.partial_fp32(x, ids, w), fused.partial_fp32(x, ids, w)
    routed_here = ((ids >= 8) & (ids < 16)).any(-1)
    assert routed_here.any() and (~routed_here).any()
    assert (a[~routed_here] == 0).all() and (b[~routed_here] == 0).all()  # other ranks' experts contribute nothing
    # at most one extra BF16 rounding per y_k (relative 2^-8) summed over <= k pairs per token
    assert (a - b).abs().max() <= 2 ** -8 * c.num_experts_per_tok * a.abs().max()
    assert (a - b).abs().max() > 0  # the grouped path really ran (its extra rounding shows)
