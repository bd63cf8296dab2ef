"""Fused MoE weight + un-permute + combine: bit-equal to the eager chain, backward math, interpreter and CUDA."""

import pytest
import torch

from beamrl.kernels.grouped_experts import sort_by_expert
from beamrl.models.beam import numerics

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only size; the CPU test covers the kernel")


def _inputs(t, k, e, h, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    order, _, _, inverse = sort_by_expert(ids, e)
    y = torch.randn(t * k, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g)
    return y.to(device), order.to(device), inverse.to(device), w.to(device)


def _eager(y, order, inverse, w, scaling):
    t, k = w.shape
    ys = (y.float() * w.reshape(-1)[order].unsqueeze(-1)).to(y.dtype)
    return numerics.moe_combine(ys[inverse].view(t, k, -1), scaling)


def test_backward_reference_matches_autograd_float64():
    from beamrl.kernels.moe_combine import backward_reference

    y, order, inverse, w = _inputs(5, 3, 6, 8, torch.float64, "cpu")
    w = w.double()
    y.requires_grad_()
    w.requires_grad_()
    out = _eager(y, order, inverse, w, 2.5)
    g = torch.randn_like(out)
    auto = torch.autograd.grad(out, (y, w), g)
    for a, r in zip(auto, backward_reference(y.detach(), inverse, w.detach(), 2.5, g)):
        torch.testing.assert_close(r.double(), a.double(), rtol=1e-5, atol=1e-6)  # moe_combine sums in FP32


def _check(checks, t, k, e, h, device, seed):
    from beamrl.kernels.moe_combine import fused_combine

    y, order, inverse, w = _inputs(t, k, e, h, torch.bfloat16, device, seed)
    n, ulps = checks.bit_mismatch(fused_combine(y, inverse, w, 2.5), _eager(y, order, inverse, w, 2.5))
    # bit-equal except a handful per 10^7 on CUDA, where torch's FP32 sum over the k slots is not always
    # summed in slot order (measured: 1-2 of 4e7 elements, <= 3 ulp)
    assert n <= 1e-6 * y.shape[0] / w.shape[1] * y.shape[1] and ulps <= 4, (n, ulps)
    ye, yf = y.clone().requires_grad_(), y.clone().requires_grad_()
    we, wf = w.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    _eager(ye, order, inverse, we, 2.5).backward(g)
    fused_combine(yf, inverse, wf, 2.5).backward(g)
    assert checks.rel_err(yf.grad, ye.grad) < 1e-2
    assert checks.rel_err(wf.grad, we.grad) < 1e-2


def test_triton_kernel_tiny(checks, kernel_device):
    _check(checks, 6, 3, 5, 24, kernel_device, seed=1)


@CUDA
def test_triton_kernel_real_width(checks):
    _check(checks, 4096, 8, 64, 5120, torch.device("cuda"), seed=2)
