"""Fused MoE un-permute + routing weight + combine (beam-numerics §3.10.7-8).

From the expert-sorted down-GEMM output y [N = T*k, H] and the position of each (token, slot) pair in that
order, one program per token computes

    out[t] = bf16(scaling * sum_k fp32(bf16(w[t, k] * fp32(y[pos(t, k)]))))

in slot order: the eager chain's gather, FP32 weight multiply, BF16 rounding, FP32 sum and scale without its
[T, k, H] intermediates. The backward pass writes dy (each sorted row exactly once) and the FP32 routing
weight gradient `scaling * <g[t], y_k>`, which flows on to the router.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import LAUNCH_OPTIONS, kernel_flags, rne_bf16


@triton.jit
def _fwd_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, H, scaling, K: tl.constexpr, BLOCK: tl.constexpr,
                ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    scaling = tl.cast(scaling, tl.float32)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + k)
        wk = tl.load(w_ptr + t * K + k)
        y = tl.load(y_ptr + pos * H + cols, mask=m, other=0.0).to(tl.float32)
        acc = acc + rne_bf16(y * wk, ROUND_BF16)
    tl.store(out_ptr + t * H + cols, rne_bf16(acc * scaling, ROUND_BF16).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd_kernel(y_ptr, pos_ptr, w_ptr, g_ptr, dy_ptr, dw_ptr, H, scaling, K: tl.constexpr, BLOCK: tl.constexpr):
    scaling = tl.cast(scaling, tl.float32)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    g = tl.load(g_ptr + t * H + cols, mask=m, other=0.0).to(tl.float32) * scaling
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + k)
        wk = tl.load(w_ptr + t * K + k)
        y = tl.load(y_ptr + pos * H + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dy_ptr + pos * H + cols, (g * wk).to(dy_ptr.dtype.element_ty), mask=m)
        tl.store(dw_ptr + t * K + k, tl.sum(g * y, axis=0))


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, positions, weights, scaling):
        t, k = weights.shape
        h = y_sorted.shape[1]
        out = torch.empty(t, h, device=y_sorted.device, dtype=y_sorted.dtype)
        block = min(1024, triton.next_power_of_2(h))  # (token, column block) programs: many small ones
        if t:
            _fwd_kernel[(t, triton.cdiv(h, block))](y_sorted, positions, weights, out, h, scaling, K=k, BLOCK=block,
                                                    num_warps=4, **kernel_flags(y_sorted.dtype), **LAUNCH_OPTIONS)
        ctx.save_for_backward(y_sorted, positions, weights)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, g):
        y_sorted, positions, weights = ctx.saved_tensors
        t, k = weights.shape
        h = y_sorted.shape[1]
        dy = torch.empty_like(y_sorted)
        dw = torch.empty(t, k, device=weights.device, dtype=torch.float32)
        block = triton.next_power_of_2(h)
        if t:
            _bwd_kernel[(t,)](y_sorted, positions, weights, g.contiguous(), dy, dw, h, ctx.scaling, K=k, BLOCK=block,
                              num_warps=_warps(block))
        return dy, None, dw.to(weights.dtype), None


def fused_combine(y_sorted: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """out [T, H] from expert-sorted y [T*k, H], positions int64 [T*k] (row of pair t*k+s in y), weights [T, k]."""
    t, k = weights.shape
    if y_sorted.dim() != 2 or y_sorted.shape[0] != t * k or positions.shape != (t * k,):
        raise ValueError(f"moe_combine: need y [T*k, H], positions [T*k] for weights {tuple(weights.shape)}, got "
                         f"{tuple(y_sorted.shape)} and {tuple(positions.shape)}")
    return _Combine.apply(y_sorted.contiguous(), positions.to(torch.int64).contiguous(),
                          weights.float().contiguous(), float(scaling))


def backward_reference(y_sorted, positions, weights, scaling, grad_out):
    """The backward kernel's math in plain torch: (dy_sorted, dweights)."""
    t, k = weights.shape
    per = y_sorted[positions].view(t, k, -1)
    dy = torch.empty_like(y_sorted)
    dy[positions] = (scaling * grad_out.unsqueeze(1) * weights.unsqueeze(-1)).reshape(t * k, -1).to(dy.dtype)
    return dy, scaling * (grad_out.unsqueeze(1) * per).sum(-1)
