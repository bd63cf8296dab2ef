"""Fused Q/K RMSNorm + RoPE / + SSMax: eager semantics, backward math, Triton kernel (interpreter and CUDA)."""

import pytest
import torch

from beamrl.kernels import ops
from beamrl.models.beam import numerics

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only size; the CPU test covers the kernel")
EPS = 1e-6


def _inputs(t, hq, hkv, d, dtype, device, seed=0, pos_offset=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g) * 2
    k = torch.randn(t, hkv, d, generator=g)
    qw = torch.randn(d, generator=g)
    kw = torch.randn(d, generator=g)
    pos = torch.arange(t) + pos_offset
    cos, sin = numerics.rope_cos_sin(pos, d, 10000.0)
    scale = numerics.ssmax_scale(pos)
    q, k, qw, kw = [x.to(device=device, dtype=dtype) for x in (q, k, qw, kw)]
    return q, k, qw, kw, cos.to(device), sin.to(device), scale.to(device)


def test_eager_rope_and_ssmax_formulas_in_float64():
    q, k, qw, kw, cos, sin, scale = _inputs(3, 4, 2, 8, torch.float64, "cpu")
    qn = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS) * qw
    kn = k / torch.sqrt((k * k).mean(-1, keepdim=True) + EPS) * kw

    def rot(x):
        x1, x2 = x[..., :4], x[..., 4:]
        c, s = cos.double()[:, None], sin.double()[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    qr, kr = ops.qk_norm_rope(q, k, qw, kw, cos, sin, EPS, backend="eager")
    torch.testing.assert_close(qr, rot(qn), rtol=1e-5, atol=1e-5)  # numerics computes in FP32
    torch.testing.assert_close(kr, rot(kn), rtol=1e-5, atol=1e-5)
    qs, ks = ops.qk_norm_ssmax(q, k, qw, kw, scale, EPS, backend="eager")
    torch.testing.assert_close(qs, qn * scale.double()[:, None, None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ks, kn, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["rope", "ssmax", "norm"])
def test_backward_reference_matches_autograd(mode):
    from beamrl.kernels.qk_norm import MODE_NORM, MODE_ROPE, MODE_SSMAX, backward_reference

    q, _, qw, _, cos, sin, scale = _inputs(3, 2, 1, 8, torch.float64, "cpu", seed=1)
    q.requires_grad_()
    qw.requires_grad_()
    n = numerics.rms_norm(q, qw, EPS)
    out = {"rope": lambda: numerics.apply_rope(n, cos, sin), "ssmax": lambda: numerics.apply_ssmax(n, scale),
           "norm": lambda: n}[mode]()
    go = torch.randn_like(out)
    auto = torch.autograd.grad(out, (q, qw), go)
    m = {"rope": MODE_ROPE, "ssmax": MODE_SSMAX, "norm": MODE_NORM}[mode]
    ref = backward_reference(q.detach(), qw.detach(), EPS, go, m, cos=cos.double(), sin=sin.double(),
                             scale=scale.double())
    for a, r in zip(auto, ref):
        torch.testing.assert_close(r, a, rtol=1e-4, atol=1e-5)


def _check_triton(checks, t, hq, hkv, d, device, seed, max_mismatch_frac, pos_offset=0):
    q, k, qw, kw, cos, sin, scale = _inputs(t, hq, hkv, d, torch.bfloat16, device, seed, pos_offset)
    # q, k as strided views of one fused projection, as the trainer produces them
    fused_qk = torch.cat((q.reshape(t, -1), k.reshape(t, -1)), dim=1)
    qv = fused_qk[:, :hq * d].view(t, hq, d)
    kv = fused_qk[:, hq * d:].view(t, hkv, d)
    for op, extra in ((ops.qk_norm_rope, (cos, sin)), (ops.qk_norm_ssmax, (scale,))):
        eager = op(q, k, qw, kw, *extra, EPS, backend="eager")
        fused = op(qv, kv, qw, kw, *extra, EPS, backend="triton")
        for f, e in zip(fused, eager):
            checks.assert_near_bit_equal(f, e, max_mismatch_frac)
        le = [x.clone().requires_grad_() for x in (q, k, qw, kw)]
        lf = [x.clone().requires_grad_() for x in (q, k, qw, kw)]
        outs_e = op(*le, *extra, EPS, backend="eager")
        grads = [torch.randn_like(o) for o in outs_e]
        torch.autograd.backward(outs_e, grads)
        torch.autograd.backward(op(*lf, *extra, EPS, backend="triton"), grads)
        for e, f in zip(le, lf):
            assert checks.rel_err(f.grad, e.grad) < 2e-2, op.__name__


@pytest.fixture(params=[(8, 1, "torch"), (4, 3, "triton"), (64, 3, "triton")],
                ids=["torch-sums", "staged-bwd", "staged-bwd-long-tiles"])
def bwd_layout(request, monkeypatch):
    """Backward layouts (qk_norm.TUNING "bwd_tokens", "bwd_stages", "bwd_finish"). The tiny test's 5 tokens
    leave a partial last token tile in each (the staged loop re-reads the last token and must store nothing);
    on a GPU the tile is first shrunk to keep every SM busy, except at real width (8192 tokens)."""
    from beamrl.kernels import qk_norm

    for key, value in zip(("bwd_tokens", "bwd_stages", "bwd_finish"), request.param):
        monkeypatch.setitem(qk_norm.TUNING, key, value)
    return request.param


def test_triton_kernel_tiny(checks, kernel_device, bwd_layout):
    _check_triton(checks, 5, 6, 2, 16, kernel_device, seed=2, max_mismatch_frac=0.05, pos_offset=1000)


@CUDA
def test_triton_kernel_real_width(checks, bwd_layout):
    # 8192 tokens: the default 64-token backward tile is not shrunk (512 programs)
    _check_triton(checks, 8192, 48, 8, 128, torch.device("cuda"), seed=3, max_mismatch_frac=1e-4, pos_offset=5000)


def test_bad_cos_shape_is_refused():
    from beamrl.kernels.qk_norm import fused_qk_norm_rope

    q, k, qw, kw, cos, sin, _ = _inputs(3, 2, 1, 8, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="cos"):
        fused_qk_norm_rope(q, k, qw, kw, cos[:2], sin, EPS)


def test_mixed_q_k_dtypes_are_refused():
    from beamrl.kernels.qk_norm import fused_qk_norm_rope

    q, k, qw, kw, cos, sin, _ = _inputs(3, 2, 1, 8, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="same dtype"):
        fused_qk_norm_rope(q, k.float(), qw, kw, cos, sin, EPS)


def test_backward_token_tile_keeps_every_sm_busy(monkeypatch):
    # The tile shrinks (not below 8) until the grid gives each SM at least 3 programs (H200: 132 SMs).
    from types import SimpleNamespace

    from beamrl.kernels import qk_norm

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setitem(qk_norm.TUNING, "bwd_tokens", 64)
    cuda = torch.device("cuda")
    assert qk_norm._bwd_token_tile(8192, 4, cuda) == 64  # 512 programs >= 396
    assert qk_norm._bwd_token_tile(6144, 4, cuda) == 32  # 384 programs at 64 would be under 3 per SM
    assert qk_norm._bwd_token_tile(4096, 4, cuda) == 32
    assert qk_norm._bwd_token_tile(100, 4, cuda) == 8
    assert qk_norm._bwd_token_tile(100, 4, torch.device("cpu")) == 64  # the interpreter: TUNING as set
