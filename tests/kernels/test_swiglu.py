"""Fused SwiGLU: bit-equal to numerics.swiglu, backward math, interpreter and CUDA."""

import pytest
import torch

from beamrl.models.beam import numerics

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only size; the CPU test covers the kernel")


def _gate_up(n, inter, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2 * inter, generator=g) * 3).to(device=device, dtype=dtype)


def test_backward_reference_matches_autograd_float64():
    from beamrl.kernels.swiglu import backward_reference

    gu = _gate_up(4, 8, torch.float64, "cpu").requires_grad_()
    act = numerics.swiglu(gu[:, :8], gu[:, 8:])
    da = torch.randn_like(act)
    (auto,) = torch.autograd.grad(act, gu, da)
    torch.testing.assert_close(backward_reference(gu.detach(), da), auto, rtol=1e-5, atol=1e-6)  # numerics: FP32


def _check(checks, n, inter, device, seed):
    from beamrl.kernels.swiglu import fused_swiglu

    gu = _gate_up(n, inter, torch.bfloat16, device, seed)
    assert checks.bit_mismatch(fused_swiglu(gu), numerics.swiglu(gu[:, :inter], gu[:, inter:])) == (0, 0.0)
    le, lf = gu.clone().requires_grad_(), gu.clone().requires_grad_()
    da = torch.randn(n, inter, device=device, dtype=torch.bfloat16)
    numerics.swiglu(le[:, :inter], le[:, inter:]).backward(da)
    fused_swiglu(lf).backward(da)
    assert checks.rel_err(lf.grad, le.grad) < 1e-2


def test_triton_kernel_tiny(checks, kernel_device):
    _check(checks, 5, 40, kernel_device, seed=1)


@CUDA
def test_triton_kernel_real_width(checks):
    _check(checks, 8192, 2560, torch.device("cuda"), seed=2)
