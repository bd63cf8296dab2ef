"""Fused output gate: eager semantics, backward math, Triton kernel (interpreter and CUDA)."""

import pytest
import torch

from beamrl.kernels import ops

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only size; the CPU test covers the kernel")


def _inputs(t, h, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(t, h, d, generator=g)
    gate = torch.randn(t, h, d, generator=g) * 3
    bias = torch.randn(h, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (o, gate, bias)]


def test_eager_three_roundings():
    o, g, b = _inputs(3, 4, 8, torch.bfloat16, "cpu")
    a = (g.float() + b.float()[:, None]).to(torch.bfloat16)
    s = torch.sigmoid(a.float()).to(torch.bfloat16)
    ref = (o.float() * s.float()).to(torch.bfloat16)
    assert torch.equal(ops.output_gate(o, g, b, backend="eager"), ref)


def test_backward_reference_matches_autograd_float64():
    from beamrl.kernels.output_gate import backward_reference

    o, g, b = [x.requires_grad_() for x in _inputs(3, 4, 8, torch.float64, "cpu", seed=1)]
    y = ops.output_gate(o, g, b, backend="eager")
    gy = torch.randn_like(y)
    auto = torch.autograd.grad(y, (o, g, b), gy)
    for a, r in zip(auto, backward_reference(o.detach(), g.detach(), b.detach(), gy)):
        torch.testing.assert_close(r, a, rtol=1e-12, atol=1e-12)


def _check_triton(checks, t, h, d, device, seed):
    o, g, b = _inputs(t, h, d, torch.bfloat16, device, seed)
    # o and g as strided views (g from a fused projection)
    g_wide = torch.cat((g.reshape(t, -1), torch.zeros(t, 8, dtype=g.dtype, device=device)), 1)
    g_view = g_wide[:, :h * d].view(t, h, d)
    eager = ops.output_gate(o, g, b, backend="eager")
    fused = ops.output_gate(o, g_view, b, backend="triton")
    assert checks.bit_mismatch(fused, eager) == (0, 0.0)
    le = [x.clone().requires_grad_() for x in (o, g, b)]
    lf = [x.clone().requires_grad_() for x in (o, g, b)]
    gy = torch.randn_like(o)
    ops.output_gate(*le, backend="eager").backward(gy)
    ops.output_gate(*lf, backend="triton").backward(gy)
    for e, f in zip(le, lf):
        assert checks.rel_err(f.grad, e.grad) < 2e-2


@pytest.mark.parametrize("t,h,d", [(4, 6, 16), (2, 130, 16)])  # one head block; two, the last one partial
def test_triton_kernel_tiny(checks, kernel_device, t, h, d):
    _check_triton(checks, t, h, d, kernel_device, seed=2)


@CUDA
def test_triton_kernel_real_width(checks):
    _check_triton(checks, 2048, 48, 128, torch.device("cuda"), seed=3)
