"""`_SplitQGateKV`: the q/gate/k/v parts of the packed projections with one joined gradient, bit for bit the
gradient of slicing them one by one (signed zeros included)."""

import pytest
import torch

from beamrl.trainer.megatron.model.attention import _SplitQGateKV


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _sliced(tokens, qpg):
    t, g, _, d = tokens.shape
    return (tokens[:, :, :qpg].reshape(t, g * qpg, d), tokens[:, :, qpg:2 * qpg].reshape(t, g * qpg, d),
            tokens[:, :, 2 * qpg].contiguous(), tokens[:, :, 2 * qpg + 1].contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups, qpg", [(2, 2), (1, 4), (4, 1)])
def test_split_equals_slices_forward_and_backward(dtype, groups, qpg):
    g = torch.Generator().manual_seed(groups * 10 + qpg)
    tokens = torch.randn(13, groups, 2 * qpg + 2, 8, generator=g).to(dtype).requires_grad_()
    want = _sliced(tokens, qpg)
    got = _SplitQGateKV.apply(tokens, qpg)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b))
        assert a._base is None or a._base is not tokens  # never a view of the input
    # gradients with exact zeros of both signs (a token whose loss weight is 0 gets them)
    grads = []
    for w in want:
        gr = torch.randn(w.shape, generator=g).to(dtype)
        gr[::3] = -0.0
        gr[1::3] = 0.0
        grads.append(gr)
    (g_want,) = torch.autograd.grad(want, tokens, grads)
    (g_got,) = torch.autograd.grad(got, tokens, grads)
    assert torch.equal(_bits(g_got), _bits(g_want))
    # a part without a gradient (unused output) counts as zeros
    (g_want2,) = torch.autograd.grad(want[:3], tokens, grads[:3])
    (g_got2,) = torch.autograd.grad(got[:3], tokens, grads[:3])
    assert torch.equal(_bits(g_got2), _bits(g_want2))
