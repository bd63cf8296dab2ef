"""Fused post-norm -> DSR -> pre-norm: eager semantics, backward math, Triton kernel (interpreter and CUDA)."""

import math

import pytest
import torch

from beamrl.kernels import ops

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only size; the CPU test covers the kernel")
SCALES = (1 / math.sqrt(6), math.sqrt(5) / math.sqrt(6))
EPS = 1e-6


def _inputs(t, h, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(t, h, generator=g) * 3
    r = torch.randn(t, h, generator=g)
    wp = torch.randn(h, generator=g)
    wq = torch.randn(h, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (b, r, wp, wq)]


def test_eager_matches_the_formula_in_float64():
    # numerics upcasts to FP32 internally (x.float()), so float64 inputs agree to FP32 precision.
    b, r, wp, wq = _inputs(5, 24, torch.float64, "cpu")
    h, p = ops.post_norm_residual_pre_norm(b, r, wp, wq, SCALES, EPS, backend="eager")
    n = b / torch.sqrt((b * b).mean(-1, keepdim=True) + EPS) * wp
    h_ref = n * SCALES[0] + r * SCALES[1]
    p_ref = h_ref / torch.sqrt((h_ref * h_ref).mean(-1, keepdim=True) + EPS) * wq
    torch.testing.assert_close(h, h_ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(p, p_ref, rtol=2e-6, atol=1e-6)
    _, none = ops.post_norm_residual_pre_norm(b, r, wp, None, SCALES, EPS, backend="eager")
    assert none is None


@pytest.mark.parametrize("with_pre,pre_grad", [(True, True), (True, False), (False, False)])
# The eager graph runs in FP32 (numerics upcasts), hence FP32-level tolerances against the float64 reference.
def test_backward_reference_matches_autograd_float64(with_pre, pre_grad):
    from beamrl.kernels.sandwich_residual import backward_reference

    b, r, wp, wq = [x.requires_grad_() for x in _inputs(4, 16, torch.float64, "cpu", seed=1)]
    wq_used = wq if with_pre else None
    h, p = ops.post_norm_residual_pre_norm(b, r, wp, wq_used, SCALES, EPS, backend="eager")
    gh = torch.randn_like(h)
    gp = torch.randn_like(h) if pre_grad else None
    outs, grads = [h], [gh]
    if pre_grad:
        outs.append(p)
        grads.append(gp)
    inputs = [b, r, wp] + ([wq] if pre_grad else [])
    auto = torch.autograd.grad(outs, inputs, grads)
    ref = backward_reference(b.detach(), r.detach(), wp.detach(), wq_used, SCALES, EPS, gh, gp)
    for a, m in zip(auto, ref):
        torch.testing.assert_close(m, a, rtol=1e-4, atol=1e-5)


def _check_triton(checks, t, h, device, seed, max_mismatch_frac):
    b, r, wp, wq = _inputs(t, h, torch.bfloat16, device, seed)
    eager = ops.post_norm_residual_pre_norm(b, r, wp, wq, SCALES, EPS, backend="eager")
    fused = ops.post_norm_residual_pre_norm(b, r, wp, wq, SCALES, EPS, backend="triton")
    for f, e in zip(fused, eager):
        checks.assert_near_bit_equal(f, e, max_mismatch_frac)
    leaves = lambda: [x.clone().requires_grad_() for x in (b, r, wp, wq)]  # noqa: E731
    gh, gp = torch.randn_like(b), torch.randn_like(b)
    le, lf = leaves(), leaves()
    torch.autograd.backward(ops.post_norm_residual_pre_norm(*le, SCALES, EPS, backend="eager"), (gh, gp))
    torch.autograd.backward(ops.post_norm_residual_pre_norm(*lf, SCALES, EPS, backend="triton"), (gh, gp))
    for e, f in zip(le, lf):
        assert checks.rel_err(f.grad, e.grad) < 2e-2
    # no pre-norm (last layer's MLP step)
    h_f, none = ops.post_norm_residual_pre_norm(b, r, wp, None, SCALES, EPS, backend="triton")
    assert none is None
    checks.assert_near_bit_equal(h_f, eager[0], max_mismatch_frac)
    # a pre-norm whose output gets no gradient (the backward's one-segment path); weights of two dtypes
    wp32 = wp.float()
    le = [x.clone().requires_grad_() for x in (b, r, wp32, wq)]
    lf = [x.clone().requires_grad_() for x in (b, r, wp32, wq)]
    ops.post_norm_residual_pre_norm(*le, SCALES, EPS, backend="eager")[0].backward(gh)
    ops.post_norm_residual_pre_norm(*lf, SCALES, EPS, backend="triton")[0].backward(gh)
    for e, f in zip(le[:3], lf[:3]):
        assert f.grad.dtype == e.grad.dtype
        assert checks.rel_err(f.grad, e.grad) < 2e-2
    assert lf[3].grad is None or not lf[3].grad.any()


@pytest.fixture(params=[("chunked", 1, "torch"), ("row", 3, "triton"), ("staged", 3, "triton")],
                ids=["chunked-fwd/plain-bwd", "row-fwd/staged-bwd", "staged-fwd/bwd"])
def forward_layout(request, monkeypatch):
    """Each layout of the kernels (sandwich_residual.TUNING "fwd_layout", "bwd_stages" and how the
    weight-gradient partials are summed, "bwd_finish")."""
    from beamrl.kernels import sandwich_residual

    for key, value in zip(("fwd_layout", "bwd_stages", "bwd_finish"), request.param):
        monkeypatch.setitem(sandwich_residual.TUNING, key, value)
    return request.param


@pytest.mark.parametrize("t,h", [(5, 48), (3, 1100)])  # one chunk; several chunks, the last one partial
def test_triton_kernel_tiny(checks, kernel_device, t, h, forward_layout):
    _check_triton(checks, t, h, kernel_device, seed=2, max_mismatch_frac=0.05)


@CUDA
def test_triton_kernel_real_width(checks, forward_layout):
    _check_triton(checks, 2048, 5120, torch.device("cuda"), seed=3, max_mismatch_frac=1e-4)


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    b, r, wp, wq = _inputs(2, 8, torch.bfloat16, "cpu")
    with pytest.raises(ops.KernelBackendError, match="CUDA"):
        ops.post_norm_residual_pre_norm(b, r, wp, wq, SCALES, EPS, backend="triton")
    with pytest.raises(ops.KernelBackendError, match="backend"):
        ops.post_norm_residual_pre_norm(b, r, wp, wq, SCALES, EPS, backend="fast")
