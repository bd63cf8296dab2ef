"""Fused per-head Q/K RMSNorm + FP32 NeoX RoPE (sliding layers) or + SSMax (full layers) (§3.3-3.5).

Each [head_dim] row of q [T, Hq, D] or k [T, Hkv, D] is read once (any token/head strides, e.g. views of a
fused QKV projection) and written once, contiguous:

    n = bf16(fp32(x) * rstd(x) * fp32(w))                       # QK-norm, one rounding
    RoPE:  out = bf16([n1*cos - n2*sin, n2*cos + n1*sin])       # FP32 cos/sin [T, D/2], one rounding
    SSMax: out = bf16(fp32(n) * s(p))                           # q only; FP32 scale [T]

The backward kernel recomputes rstd from x and rotates/scales the gradient back; the norm-weight gradient is
summed from per-program FP32 partials. `backward_reference` is the same math in plain torch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import LAUNCH_OPTIONS, kernel_flags, mul_rn, num_programs_for_reduction, rne_bf16

MODE_NORM, MODE_ROPE, MODE_SSMAX = 0, 1, 2
_BLOCK_ROWS = 16


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, scale_ptr, out_ptr, R, heads, stride_t, stride_h, inv_d, eps,
                MODE: tl.constexpr, HALF: tl.constexpr, BR: tl.constexpr, ROUND_BF16: tl.constexpr,
                INTERPRET: tl.constexpr):
    inv_d = tl.cast(inv_d, tl.float32)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    t = rows // heads
    hd = rows % heads
    c = tl.arange(0, HALF)
    m2 = rmask[:, None]
    src = (t * stride_t + hd * stride_h)[:, None] + c[None, :]
    x1 = tl.load(x_ptr + src, mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + src + HALF, mask=m2, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + c).to(tl.float32)[None, :]
    ss = tl.sum(mul_rn(x1, x1, INTERPRET), axis=1) + tl.sum(mul_rn(x2, x2, INTERPRET), axis=1)
    rstd = tl.math.rsqrt(mul_rn(ss, inv_d, INTERPRET) + eps)[:, None]
    n1 = rne_bf16(x1 * rstd * w1, ROUND_BF16)
    n2 = rne_bf16(x2 * rstd * w2, ROUND_BF16)
    if MODE == 1:
        cs = t[:, None] * HALF + c[None, :]
        co = tl.load(cos_ptr + cs, mask=m2, other=0.0)
        si = tl.load(sin_ptr + cs, mask=m2, other=0.0)
        o1 = rne_bf16(mul_rn(n1, co, INTERPRET) - mul_rn(n2, si, INTERPRET), ROUND_BF16)
        o2 = rne_bf16(mul_rn(n2, co, INTERPRET) + mul_rn(n1, si, INTERPRET), ROUND_BF16)
    elif MODE == 2:
        sc = tl.load(scale_ptr + t, mask=rmask, other=0.0)[:, None]
        o1 = rne_bf16(n1 * sc, ROUND_BF16)
        o2 = rne_bf16(n2 * sc, ROUND_BF16)
    else:
        o1 = n1
        o2 = n2
    dst = rows[:, None] * (2 * HALF) + c[None, :]
    tl.store(out_ptr + dst, o1.to(out_ptr.dtype.element_ty), mask=m2)
    tl.store(out_ptr + dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _bwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, scale_ptr, go_ptr, dx_ptr, dw_ptr, R, heads, stride_t, stride_h,
                inv_d, eps, blocks_per_prog, MODE: tl.constexpr, HALF: tl.constexpr, BR: tl.constexpr):
    inv_d = tl.cast(inv_d, tl.float32)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    c = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + c).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + c).to(tl.float32)[None, :]
    acc1 = tl.zeros([HALF], dtype=tl.float32)
    acc2 = tl.zeros([HALF], dtype=tl.float32)
    for i in range(blocks_per_prog):
        rows = (pid.to(tl.int64) * blocks_per_prog + i) * BR + tl.arange(0, BR)
        rmask = rows < R
        m2 = rmask[:, None]
        t = rows // heads
        hd = rows % heads
        src = (t * stride_t + hd * stride_h)[:, None] + c[None, :]
        x1 = tl.load(x_ptr + src, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + src + HALF, mask=m2, other=0.0).to(tl.float32)
        dst = rows[:, None] * (2 * HALF) + c[None, :]
        g1 = tl.load(go_ptr + dst, mask=m2, other=0.0).to(tl.float32)
        g2 = tl.load(go_ptr + dst + HALF, mask=m2, other=0.0).to(tl.float32)
        if MODE == 1:
            cs = t[:, None] * HALF + c[None, :]
            co = tl.load(cos_ptr + cs, mask=m2, other=0.0)
            si = tl.load(sin_ptr + cs, mask=m2, other=0.0)
            gn1 = g1 * co + g2 * si
            gn2 = g2 * co - g1 * si
        elif MODE == 2:
            sc = tl.load(scale_ptr + t, mask=rmask, other=0.0)[:, None]
            gn1 = g1 * sc
            gn2 = g2 * sc
        else:
            gn1 = g1
            gn2 = g2
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.math.rsqrt(ss * inv_d + eps)[:, None]
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        gw1 = gn1 * w1
        gw2 = gn2 * w2
        dot = ((tl.sum(gw1 * xh1, axis=1) + tl.sum(gw2 * xh2, axis=1)) * inv_d)[:, None]
        tl.store(dx_ptr + dst, (rstd * (gw1 - xh1 * dot)).to(dx_ptr.dtype.element_ty), mask=m2)
        tl.store(dx_ptr + dst + HALF, (rstd * (gw2 - xh2 * dot)).to(dx_ptr.dtype.element_ty), mask=m2)
        acc1 += tl.sum(gn1 * xh1, axis=0)
        acc2 += tl.sum(gn2 * xh2, axis=0)
    tl.store(dw_ptr + pid * (2 * HALF) + c, acc1)
    tl.store(dw_ptr + pid * (2 * HALF) + HALF + c, acc2)


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, heads, head_dim] with a unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    d = x.shape[-1]
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"{name}: head_dim must be twice a power of two for this kernel, got {d}")


class _QKNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, cos, sin, scale, eps, mode):
        t, heads, d = x.shape
        rows = t * heads
        out = torch.empty((t, heads, d), device=x.device, dtype=x.dtype)
        dummy = w
        _fwd_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
            x, w, cos if cos is not None else dummy, sin if sin is not None else dummy,
            scale if scale is not None else dummy, out, rows, heads, x.stride(0), x.stride(1), 1.0 / d, eps,
            MODE=mode, HALF=d // 2, BR=_BLOCK_ROWS, num_warps=4, **kernel_flags(x.dtype), **LAUNCH_OPTIONS)
        ctx.save_for_backward(x, w, cos, sin, scale)
        ctx.eps, ctx.mode = eps, mode
        return out

    @staticmethod
    def backward(ctx, go):
        x, w, cos, sin, scale = ctx.saved_tensors
        t, heads, d = x.shape
        rows = t * heads
        blocks = triton.cdiv(rows, _BLOCK_ROWS)
        progs = num_programs_for_reduction(x.device, blocks)
        per_prog = triton.cdiv(blocks, progs)
        dx = torch.empty((t, heads, d), device=x.device, dtype=x.dtype)
        dw = torch.empty(progs, d, device=x.device, dtype=torch.float32)
        dummy = w
        _bwd_kernel[(progs,)](
            x, w, cos if cos is not None else dummy, sin if sin is not None else dummy,
            scale if scale is not None else dummy, go.contiguous(), dx, dw, rows, heads, x.stride(0), x.stride(1),
            1.0 / d, ctx.eps, per_prog, MODE=ctx.mode, HALF=d // 2, BR=_BLOCK_ROWS, num_warps=4)
        return dx, dw.sum(0).to(w.dtype), None, None, None, None, None


def qk_norm_one(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int, cos: Optional[torch.Tensor] = None,
                sin: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Norm (+ RoPE or SSMax) of one of q or k; see the module docstring."""
    _check(x, "q/k")
    t, _, d = x.shape
    if mode == MODE_ROPE:
        for name, v in (("cos", cos), ("sin", sin)):
            if v is None or v.shape != (t, d // 2) or v.dtype != torch.float32:
                raise ValueError(f"qk_norm_rope: {name} must be FP32 [{t}, {d // 2}], got "
                                 f"{None if v is None else (tuple(v.shape), v.dtype)}")
        cos, sin = cos.contiguous(), sin.contiguous()
    if mode == MODE_SSMAX:
        if scale is None or scale.shape != (t,) or scale.dtype != torch.float32:
            raise ValueError(f"qk_norm_ssmax: scale must be FP32 [{t}], got "
                             f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")
        scale = scale.contiguous()
    return _QKNorm.apply(x, weight.contiguous(), cos, sin, scale, float(eps), mode)


def fused_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    """Triton implementation of `ops.qk_norm_rope`."""
    return (qk_norm_one(q, q_weight, eps, MODE_ROPE, cos=cos, sin=sin),
            qk_norm_one(k, k_weight, eps, MODE_ROPE, cos=cos, sin=sin))


def fused_qk_norm_ssmax(q, k, q_weight, k_weight, scale, eps):
    """Triton implementation of `ops.qk_norm_ssmax` (SSMax on q only)."""
    return qk_norm_one(q, q_weight, eps, MODE_SSMAX, scale=scale), qk_norm_one(k, k_weight, eps, MODE_NORM)


def backward_reference(x, weight, eps, grad_out, mode, cos=None, sin=None, scale=None):
    """The backward kernel's math in plain torch: returns (dx, dweight). x [T, H, D]; roundings are identity."""
    half = x.shape[-1] // 2
    g1, g2 = grad_out[..., :half], grad_out[..., half:]
    if mode == MODE_ROPE:
        co, si = cos.unsqueeze(1), sin.unsqueeze(1)
        gn = torch.cat((g1 * co + g2 * si, g2 * co - g1 * si), dim=-1)
    elif mode == MODE_SSMAX:
        gn = grad_out * scale.view(-1, 1, 1)
    else:
        gn = grad_out
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xh = x * rstd
    gw = gn * weight
    dx = rstd * (gw - xh * (gw * xh).mean(-1, keepdim=True))
    return dx, (gn * xh).reshape(-1, x.shape[-1]).sum(0)
