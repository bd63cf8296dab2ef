"""Packed sliding-window attention: eager vs a dense masked reference, FlexAttention forward (CPU) and
forward+backward (CUDA)."""

import math
import warnings

import pytest
import torch

from beamrl.kernels import ops

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA")


def _inputs(t, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv)]


def _dense_reference(q, k, v, cu, window):
    """Independent reference: one [T, T] mask built element by element from the packing."""
    t = q.shape[0]
    mask = torch.zeros(t, t, dtype=torch.bool)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        for i in range(s, e):
            lo = s if window is None else max(s, i - (window - 1))
            mask[i, lo:i + 1] = True
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    sc = torch.einsum("qhd,khd->hqk", q.double(), kk) / math.sqrt(q.shape[-1])
    p = torch.softmax(sc.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize("window", [None, 4])
def test_eager_and_flex_forward_match_dense_reference(window):
    q, k, v = _inputs(30, 4, 2, 8, torch.float32, "cpu")
    cu = torch.tensor([0, 7, 19, 30])
    ref = _dense_reference(q, k, v, cu, window)
    torch.testing.assert_close(ops.attention(q, k, v, cu, window, backend="eager").double(), ref,
                               rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():  # uncompiled FlexAttention on CPU warns; forward only on CPU
        warnings.simplefilter("ignore")
        flex = ops.attention(q, k, v, cu, window, backend="flex")
    torch.testing.assert_close(flex.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_cu_seqlens_is_refused():
    q, k, v = _inputs(10, 2, 1, 8, torch.float32, "cpu")
    with pytest.raises(ops.KernelBackendError, match="cu_seqlens"):
        ops.attention(q, k, v, torch.tensor([0, 4, 9]), None, backend="eager")


@CUDA
@pytest.mark.parametrize("window", [None, 512])
def test_flex_forward_backward_cuda(checks, window):
    q, k, v = _inputs(2048, 48, 8, 128, torch.bfloat16, "cuda", seed=1)
    cu = torch.tensor([0, 700, 1500, 2048], device="cuda")
    le = [x.clone().requires_grad_() for x in (q, k, v)]
    lf = [x.clone().requires_grad_() for x in (q, k, v)]
    oe = ops.attention(*le, cu, window, backend="eager")
    of = ops.attention(*lf, cu, window, backend="flex")
    assert checks.rel_err(of, oe) < 1e-2
    go = torch.randn_like(oe)
    oe.backward(go)
    of.backward(go)
    for a, b in zip(le, lf):
        assert checks.rel_err(b.grad, a.grad) < 2e-2


def test_the_compiled_wrapper_is_never_built_while_tracing(monkeypatch):
    # Under an outer torch.compile the plain function is returned (and traced into that graph); the compiled
    # wrapper is only built, once, outside any trace. Built during tracing, it later ran uncompiled (H200: 6x slower).
    from beamrl.kernels import flex_attention as fa

    monkeypatch.setattr(fa, "_COMPILED", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fa._flex_fn(torch.device("cuda")) is fa.flex_attention
    assert fa._COMPILED == {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    built = fa._flex_fn(torch.device("cuda"))
    assert list(fa._COMPILED) == ["cuda"] and built is fa._COMPILED["cuda"]
    assert fa._flex_fn(torch.device("cuda")) is built
    assert fa._flex_fn(torch.device("cpu")) is fa.flex_attention
