"""Fused grouped sigmoid top-k on FP32 router logits (beam-numerics §3.10.2-5).

One program per block of tokens reads the FP32 logits [T, E] once and writes the FP32 weights and int64 ids
[T, k]: sigmoid (PyTorch's `1/(1+expf(-z))`), + correction bias, per-group top-2 sum, keep `topk_group` groups,
top-k experts among them by iterative arg-max, weights = unbiased scores renormalised `w / (sum w + 1e-20)`.

The logits GEMM stays a torch FP32 matmul: it is [T, H] x [H, E] with E = 256, a skinny GEMM cuBLAS SGEMM
already runs near its roofline, and the FP32 contract (no TF32) rules out a BF16 tensor-core Triton GEMM.

Ids come out sorted by biased score (descending; ties to the lower expert id). The weight sum runs in that
order, so a weight can differ from the eager reference (whose order follows `topk(sorted=False)`) in the last
FP32 bit; the ids are the same set. The backward pass (only the weights carry gradient) is plain torch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import kernel_flags, sigmoid_f32
from beamrl.models.beam.numerics import RENORM_EPS

_BLOCK_T = 16


@triton.jit
def _topk_kernel(z_ptr, bias_ptr, w_ptr, id_ptr, T, eps, E: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                 KG: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, ROUND_BF16: tl.constexpr,
                 INTERPRET: tl.constexpr):
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BT + tl.arange(0, BT)
    rm = rows < T
    e = tl.arange(0, E)
    z = tl.load(z_ptr + rows[:, None] * E + e[None, :], mask=rm[:, None], other=0.0)
    s = sigmoid_f32(z, INTERPRET)
    c = s + tl.load(bias_ptr + e)[None, :]
    GS: tl.constexpr = E // G
    c3 = tl.reshape(c, (BT, G, GS))
    j = tl.arange(0, GS)
    a1 = tl.argmax(c3, axis=2)
    m1 = tl.max(c3, axis=2)
    m2 = tl.max(tl.where(j[None, None, :] == a1[:, :, None], float("-inf"), c3), axis=2)
    gscore = m1 + m2
    gidx = tl.arange(0, G)
    keep = tl.zeros([BT, G], dtype=tl.float32)
    for _ in tl.static_range(KG):
        ga = tl.argmax(gscore, axis=1)
        hit = gidx[None, :] == ga[:, None]
        keep = tl.where(hit, 1.0, keep)
        gscore = tl.where(hit, float("-inf"), gscore)
    keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], (BT, G, GS)), (BT, E))
    masked = tl.where(keep_e > 0.5, c, float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros([BT, KP], dtype=tl.int64)
    ws = tl.zeros([BT, KP], dtype=tl.float32)
    for i in tl.static_range(K):
        a = tl.argmax(masked, axis=1)
        hit = e[None, :] == a[:, None]
        sv = tl.sum(tl.where(hit, s, 0.0), axis=1)
        ids = tl.where(kk[None, :] == i, a[:, None].to(tl.int64), ids)
        ws = tl.where(kk[None, :] == i, sv[:, None], ws)
        masked = tl.where(hit, float("-inf"), masked)
    total = tl.sum(ws, axis=1) + eps
    w = tl.math.div_rn(ws, total[:, None])
    km = rm[:, None] & (kk[None, :] < K)
    tl.store(w_ptr + rows[:, None] * K + kk[None, :], w, mask=km)
    tl.store(id_ptr + rows[:, None] * K + kk[None, :], ids, mask=km)


def weights_backward(logits: torch.Tensor, ids: torch.Tensor, grad_w: torch.Tensor) -> torch.Tensor:
    """d loss / d logits of `w = s[ids] / (sum s[ids] + eps)`, s = sigmoid(logits): dense [T, E], zero off ids."""
    s = torch.sigmoid(logits.gather(1, ids))
    total = s.sum(-1, keepdim=True) + RENORM_EPS
    ds = (grad_w - (grad_w * s).sum(-1, keepdim=True) / total) / total
    return torch.zeros_like(logits).scatter_(1, ids, ds * s * (1 - s))


class _GroupedTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group):
        t, e = logits.shape
        w = torch.empty(t, top_k, device=logits.device, dtype=torch.float32)
        ids = torch.empty(t, top_k, device=logits.device, dtype=torch.int64)
        flags = kernel_flags(torch.float32)
        _topk_kernel[(triton.cdiv(t, _BLOCK_T),)](logits, bias, w, ids, t, RENORM_EPS, E=e, G=n_group, K=top_k,
                                                KG=topk_group, KP=triton.next_power_of_2(top_k), BT=_BLOCK_T,
                                                num_warps=4, **flags)
        ctx.save_for_backward(logits, ids)
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, grad_w, _grad_ids):
        logits, ids = ctx.saved_tensors
        return weights_backward(logits, ids, grad_w), None, None, None, None


def fused_grouped_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                       topk_group: int, forced_ids: Optional[torch.Tensor] = None):
    """Triton implementation of the selection part of `ops.route` (logits FP32 [T, E])."""
    from beamrl.models.beam import numerics

    if forced_ids is not None:  # replay: no selection to fuse, the weights are a gather + renorm
        return numerics.routing_weights(torch.sigmoid(logits), forced_ids), forced_ids
    t, e = logits.shape
    if e % n_group or (e & (e - 1)) or (n_group & (n_group - 1)) or e // n_group < 2:
        raise ValueError(f"route(triton): num_experts ({e}) and n_group ({n_group}) must be powers of two with "
                         f"at least 2 experts per group")
    if not (1 <= topk_group <= n_group and 1 <= top_k <= topk_group * (e // n_group)):
        raise ValueError(f"route: need 1 <= topk_group ({topk_group}) <= n_group ({n_group}) and "
                         f"1 <= top_k ({top_k}) <= topk_group * experts per group")
    return _GroupedTopK.apply(logits.float().contiguous(), correction_bias.float().contiguous(), top_k, n_group,
                              topk_group)
