"""Fused output gate: per-head bias add, sigmoid and multiply in one pass (beam-numerics §3.7).

    y = bf16(o * bf16(sigmoid(bf16(g + b_h))))        # three roundings, as SGLang's gate kernel

o, g: [T, H, D] (any token/head strides, unit last stride); bias: [H]. One program per (tokens, block of heads)
reads o and g once and writes y once. The backward pass recomputes the gate from g and writes d_o, d_g and per-program
bias-gradient partials (summed by `partial_sums`). The sigmoid is PyTorch's `1 / (1 + expf(-x))` with libdevice expf
and an IEEE division, so the BF16 forward equals the eager reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import (LAUNCH_OPTIONS, kernel_flags, num_programs_for_reduction, rne_bf16,
                                          sigmoid_f32)
from beamrl.kernels.partial_sums import weight_gradients


# Launch tuning (benchmarks/kernel_sweep.py times the choices on a GPU). Outputs do not depend on it; bwd_per_sm
# and bwd_elems regroup the FP32 partials of the bias gradient (its last bits).
TUNING: dict = {"fwd_elems": 2048, "fwd_tokens": 1, "fwd_warps": 4, "bwd_elems": 2048, "bwd_warps": 4,
                "bwd_per_sm": 2}


@triton.jit
def _fwd_kernel(o_ptr, g_ptr, b_ptr, y_ptr, T, H, so_t, so_h, sg_t, sg_h, D: tl.constexpr, HB: tl.constexpr,
                TB: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, D)
    hm = h < H
    b = tl.load(b_ptr + h, mask=hm, other=0.0).to(tl.float32)[:, None]
    for i in range(TB):
        t = tl.program_id(0).to(tl.int64) * TB + i
        m2 = hm[:, None] & (t < T)
        o = tl.load(o_ptr + t * so_t + (h * so_h)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * sg_t + (h * sg_h)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        a = rne_bf16(g + b, ROUND_BF16)
        s = rne_bf16(sigmoid_f32(a, INTERPRET), ROUND_BF16)
        y = rne_bf16(o * s, ROUND_BF16)
        tl.store(y_ptr + t * (H * D) + (h * D)[:, None] + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _bwd_kernel(o_ptr, g_ptr, b_ptr, gy_ptr, do_ptr, dg_ptr, db_ptr, T, H, so_t, so_h, sg_t, sg_h,
                rows_per_prog, D: tl.constexpr, HB: tl.constexpr, ROUND_BF16: tl.constexpr,
                INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, D)
    hm = h < H
    b = tl.load(b_ptr + h, mask=hm, other=0.0).to(tl.float32)[:, None]
    acc = tl.zeros([HB], dtype=tl.float32)
    for i in range(rows_per_prog):
        t = pid.to(tl.int64) * rows_per_prog + i
        m2 = hm[:, None] & (t < T)
        o = tl.load(o_ptr + t * so_t + (h * so_h)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * sg_t + (h * sg_h)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        dst = t * (H * D) + (h * D)[:, None] + d[None, :]
        gy = tl.load(gy_ptr + dst, mask=m2, other=0.0).to(tl.float32)
        s = rne_bf16(sigmoid_f32(rne_bf16(g + b, ROUND_BF16), INTERPRET), ROUND_BF16)
        ga = gy * o * s * (1.0 - s)
        tl.store(do_ptr + dst, (gy * s).to(do_ptr.dtype.element_ty), mask=m2)
        tl.store(dg_ptr + dst, ga.to(dg_ptr.dtype.element_ty), mask=m2)
        acc += tl.sum(tl.where(m2, ga, 0.0), axis=1)
    tl.store(db_ptr + pid * H + h, acc, mask=hm)


def _head_block(heads: int, d: int, elems: int) -> int:
    """Heads per program: about `elems` elements per program, a power of two (48 heads, 2048 -> 3 x 16)."""
    return min(triton.next_power_of_2(heads), max(1, elems // d))


class _OutputGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, g, bias):
        t, heads, d = o.shape
        y = torch.empty((t, heads, d), device=o.device, dtype=o.dtype)
        hb = _head_block(heads, d, int(TUNING["fwd_elems"]))
        tb = int(TUNING["fwd_tokens"])
        if t:
            _fwd_kernel[(triton.cdiv(t, tb), triton.cdiv(heads, hb))](
                o, g, bias, y, t, heads, o.stride(0), o.stride(1), g.stride(0), g.stride(1), D=d, HB=hb, TB=tb,
                num_warps=int(TUNING["fwd_warps"]), **kernel_flags(o.dtype), **LAUNCH_OPTIONS)
        ctx.save_for_backward(o, g, bias)
        return y

    @staticmethod
    def backward(ctx, gy):
        o, g, bias = ctx.saved_tensors
        t, heads, d = o.shape
        progs = num_programs_for_reduction(o.device, max(t, 1), int(TUNING["bwd_per_sm"]))
        per_prog = triton.cdiv(t, progs)
        d_o = torch.empty((t, heads, d), device=o.device, dtype=o.dtype)
        d_g = torch.empty((t, heads, d), device=o.device, dtype=g.dtype)
        db = torch.empty(progs, heads, device=o.device, dtype=torch.float32)
        hb = _head_block(heads, d, int(TUNING["bwd_elems"]))
        _bwd_kernel[(progs, triton.cdiv(heads, hb))](o, g, bias, gy.contiguous(), d_o, d_g, db, t, heads,
                                                     o.stride(0), o.stride(1), g.stride(0), g.stride(1), per_prog,
                                                     D=d, HB=hb, num_warps=int(TUNING["bwd_warps"]),
                                                     **kernel_flags(o.dtype), **LAUNCH_OPTIONS)
        return d_o, d_g, weight_gradients(db, (progs,), (bias.dtype,))[0]


def fused_output_gate(o: torch.Tensor, g: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Triton implementation of `ops.output_gate`."""
    if o.dim() != 3 or o.shape != g.shape or bias.shape != (o.shape[1],):
        raise ValueError(f"output_gate: o and g must be [T, H, D] and bias [H], got o {tuple(o.shape)}, "
                         f"g {tuple(g.shape)}, bias {tuple(bias.shape)}")
    d = o.shape[-1]
    if o.stride(-1) != 1 or g.stride(-1) != 1 or d & (d - 1):
        raise ValueError(f"output_gate: head_dim must be a power of two with unit stride, got {d}, strides "
                         f"{o.stride()} / {g.stride()}")
    return _OutputGate.apply(o, g, bias.to(g.dtype).contiguous())


def backward_reference(o, g, bias, grad_y):
    """The backward kernel's math in plain torch: (d_o, d_g, d_bias); roundings are identity."""
    s = torch.sigmoid(g + bias.view(1, -1, 1))
    ga = grad_y * o * s * (1 - s)
    return grad_y * s, ga, ga.sum(dim=(0, 2))
