"""Eager packed attention batched by sequence length equals the per-sequence loop bit for bit."""

import itertools

import pytest
import torch

from beamrl.kernels import ops
from beamrl.kernels.packed_attention import attention_plan, length_groups, packed_attention
from beamrl.models.beam import numerics


def _per_sequence(q, k, v, bounds, window):
    """The loop `ops.attention` ran before: one `numerics.attention` call per sequence."""
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        pos = torch.arange(end - start)
        out[start:end] = numerics.attention(q[start:end], k[start:end], v[start:end],
                                            numerics.sliding_window_mask(pos, pos, window))
    return out


LAYOUTS = {
    "quickstart-like": [6, 7, 6, 5, 7, 7, 6, 4] * 3,  # a few lengths, interleaved
    "one length": [5] * 12,  # the single-group path (a view, no gather)
    "all different": [3, 17, 12, 2, 9],
    "one sequence": [23],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_equals_the_per_sequence_loop_forward_and_backward(layout, window, dtype):
    lengths = LAYOUTS[layout]
    bounds = [0, *itertools.accumulate(lengths)]
    T = bounds[-1]
    g = torch.Generator().manual_seed(len(lengths) + (window or 0))
    q, k, v = (torch.randn(T, h, 16, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2))
    grad_out = torch.randn(T, 4, 16, generator=g).to(dtype)
    ref = _per_sequence(q, k, v, bounds, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = ops.attention(q, k, v, torch.tensor(bounds), window, backend="eager")
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)


def test_plan_groups_every_token_once_and_is_shared_by_layers():
    bounds = (0, 3, 5, 8, 9, 11)
    assert length_groups(bounds) == {3: [0, 5], 2: [3, 9], 1: [8]}
    plan = attention_plan(bounds, None, torch.device("cpu"))
    assert attention_plan(bounds, None, torch.device("cpu")) is plan  # every layer of a forward reuses it
    order = torch.cat([grp.index.flatten() for grp in plan.groups])
    assert sorted(order.tolist()) == list(range(11))
    assert torch.equal(order[plan.inverse], torch.arange(11))
    q = torch.randn(11, 2, 8)
    assert torch.equal(packed_attention(q, q[:, :1], q[:, :1], list(bounds), 2),
                       _per_sequence(q, q[:, :1], q[:, :1], list(bounds), 2))
