"""Routing: eager grouped top-k semantics, replay gradients, the fused top-k kernel (interpreter and CUDA)."""

import pytest
import torch

from beamrl.kernels import ops
from beamrl.models.beam import numerics

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only size; the CPU test covers the kernel")


def _inputs(t, h, e, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w = torch.randn(e, h, generator=g) * 0.05
    bias = torch.randn(e, generator=g) * 0.01
    return x.to(device), w.to(device), bias.to(device)


def _brute_force_route(x, w, bias, top_k, n_group, topk_group):
    """Independent reference: enumerate the kept groups per token in Python."""
    s = torch.sigmoid(x.double() @ w.double().t())
    c = s + bias.double()
    per = c.shape[1] // n_group
    ids = []
    for row in c:
        groups = sorted(range(n_group), key=lambda gi: -float(row[gi * per:(gi + 1) * per].topk(2)[0].sum()))
        allowed = [gi * per + j for gi in groups[:topk_group] for j in range(per)]
        ids.append(sorted(allowed, key=lambda ei: -float(row[ei]))[:top_k])
    ids = torch.tensor(ids)
    ws = s.gather(1, ids)
    return ws / ws.sum(-1, keepdim=True), ids


def _as_sets(w, ids):
    order = ids.argsort(1)
    return w.gather(1, order), ids.gather(1, order)


def test_eager_route_matches_brute_force():
    x, w, bias = _inputs(12, 16, 32, "cpu")
    we, ie = ops.route(x, w, bias, 4, 4, 2, backend="eager")
    wr, ir = _brute_force_route(x, w, bias, 4, 4, 2)
    we, ie = _as_sets(we, ie)
    wr, ir = _as_sets(wr, ir)
    assert torch.equal(ie, ir)
    torch.testing.assert_close(we.double(), wr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_replay_takes_forced_ids_and_gradients_reach_router_and_x(backend, kernel_device):
    x, w, bias = _inputs(6, 16, 32, kernel_device)
    forced = torch.stack([torch.randperm(32)[:4] for _ in range(6)]).to(kernel_device)
    x.requires_grad_()
    w.requires_grad_()
    weights, ids = ops.route(x, w, bias, 4, 4, 2, forced_ids=forced, backend=backend)
    assert torch.equal(ids, forced)
    scores = torch.sigmoid(x.detach().float() @ w.detach().t())
    torch.testing.assert_close(weights, numerics.routing_weights(scores, forced))
    (weights * torch.randn_like(weights)).sum().backward()
    assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0


def test_weights_backward_matches_autograd_float64():
    from beamrl.kernels.router_topk import weights_backward

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(5)])
    w = numerics.routing_weights(torch.sigmoid(logits), ids)
    gw = torch.randn_like(w)
    (auto,) = torch.autograd.grad(w, logits, gw)
    # routing_weights sums in FP32, hence FP32-level tolerances
    torch.testing.assert_close(weights_backward(logits.detach(), ids, gw), auto, rtol=1e-6, atol=1e-8)


def _check_triton(t, h, e, n_group, topk_group, top_k, device, seed):
    x, w, bias = _inputs(t, h, e, device, seed)
    we, ie = _as_sets(*ops.route(x, w, bias, top_k, n_group, topk_group, backend="eager"))
    wf, idf = _as_sets(*ops.route(x, w, bias, top_k, n_group, topk_group, backend="triton"))
    assert torch.equal(idf, ie)
    # same set; the renormalising sum runs in another order: last FP32 bit at most
    torch.testing.assert_close(wf, we, rtol=3e-7, atol=0)
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    rwe, rwf = w.clone().requires_grad_(), w.clone().requires_grad_()
    w_e, i_e = ops.route(xe, rwe, bias, top_k, n_group, topk_group, backend="eager")
    w_f, i_f = ops.route(xf, rwf, bias, top_k, n_group, topk_group, backend="triton")
    # the same upstream gradient per (token, expert), whatever the slot order
    table = torch.randn(t, e, device=device)
    (w_e * table.gather(1, i_e)).sum().backward()
    (w_f * table.gather(1, i_f)).sum().backward()
    torch.testing.assert_close(rwf.grad, rwe.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(xf.grad.float(), xe.grad.float(), rtol=2e-2, atol=1e-3)


def test_triton_kernel_tiny(kernel_device):
    _check_triton(10, 16, 64, 8, 4, 8, kernel_device, seed=4)


@CUDA
def test_triton_kernel_real_width():
    _check_triton(4096, 5120, 256, 8, 4, 8, torch.device("cuda"), seed=5)


def test_non_fp32_router_weight_is_refused():
    x, w, bias = _inputs(2, 8, 16, "cpu")
    with pytest.raises(ops.KernelBackendError, match="FP32"):
        ops.route(x, w.to(torch.bfloat16), bias, 2, 2, 1, backend="eager")
