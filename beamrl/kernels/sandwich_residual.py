"""Fused sandwich post-norm -> depth-scaled residual -> next pre-norm (beam-numerics §3.2, §3.8).

The forward reads the sublayer output and the residual from DRAM once (re-reads hit L2) and writes the new
residual and the next sublayer's normed input; by default a few programs per SM walk the rows through a
pipelined loop (TUNING "fwd_layout" has the alternatives):

    n  = bf16(fp32(branch) * rstd(branch) * fp32(w_post))
    h' = bf16(bf16(n * s_b) + bf16(h * s_r))          # s_b, s_r FP32 scalars
    p  = bf16(fp32(h') * rstd(h') * fp32(w_pre))

The backward pass (one pass per row, one program per SM walking rows through a pipelined loop, weight
gradients as per-program FP32 partials summed by `partial_sums`) treats the roundings as identity, as
autograd through the eager reference does. `backward_reference` is the same math in plain torch, tested
against autograd in float64.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import LAUNCH_OPTIONS, kernel_flags, mul_rn, num_programs_for_reduction, rne_bf16
from beamrl.kernels.partial_sums import weight_gradients


@triton.jit
def _residual(b, r, wp, rstd, s_branch, s_res, ROUND_BF16: tl.constexpr):
    """h' = bf16(bf16(n * s_b) + bf16(h * s_r)) with n = bf16(b * rstd * w_post), all in FP32 registers."""
    n = rne_bf16(b * rstd * wp, ROUND_BF16)
    return rne_bf16(rne_bf16(n * s_branch, ROUND_BF16) + rne_bf16(r * s_res, ROUND_BF16), ROUND_BF16)


@triton.jit
def _residual_chunk(branch_ptr, residual_ptr, post_w_ptr, row, stride_b, stride_r, cols, m, rstd, s_branch, s_res,
                    ROUND_BF16: tl.constexpr):
    """`_residual` of one chunk of a row, loading its branch, residual and post-norm weight."""
    b = tl.load(branch_ptr + row * stride_b + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    wp = tl.load(post_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    return _residual(b, r, wp, rstd, s_branch, s_res, ROUND_BF16)


@triton.jit
def _fwd_kernel(branch_ptr, residual_ptr, post_w_ptr, pre_w_ptr, out_res_ptr, out_pre_ptr, rstd_post_ptr,
                rstd_pre_ptr, stride_b, stride_r, stride_o, stride_p, H, inv_h, eps, s_branch, s_res,
                HAS_PRE: tl.constexpr, CHUNK: tl.constexpr, ONE_PASS: tl.constexpr, ROUND_BF16: tl.constexpr,
                INTERPRET: tl.constexpr):
    # One row per program. ONE_PASS (CHUNK >= H): the whole row lives in registers, every input is loaded once.
    # Otherwise the row is walked in CHUNK-wide pieces (few live registers): pass 1 sums the branch's squares,
    # pass 2 does the post-norm and residual add and stores h', pass 3 the next pre-norm, recomputing h' from
    # the branch and residual (L2 hits, not DRAM).
    inv_h = tl.cast(inv_h, tl.float32)
    eps = tl.cast(eps, tl.float32)
    s_branch = tl.cast(s_branch, tl.float32)
    s_res = tl.cast(s_res, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    if ONE_PASS:
        m = offs < H
        b = tl.load(branch_ptr + row * stride_b + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.load(residual_ptr + row * stride_r + offs, mask=m, other=0.0).to(tl.float32)
        wp = tl.load(post_w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(mul_rn(tl.sum(mul_rn(b, b, INTERPRET), axis=0), inv_h, INTERPRET) + eps)
        tl.store(rstd_post_ptr + row, rstd)
        h = _residual(b, r, wp, rstd, s_branch, s_res, ROUND_BF16)
        tl.store(out_res_ptr + row * stride_o + offs, h.to(out_res_ptr.dtype.element_ty), mask=m)
        if HAS_PRE:
            wq = tl.load(pre_w_ptr + offs, mask=m, other=0.0).to(tl.float32)
            rstd2 = tl.math.rsqrt(mul_rn(tl.sum(mul_rn(h, h, INTERPRET), axis=0), inv_h, INTERPRET) + eps)
            tl.store(rstd_pre_ptr + row, rstd2)
            p = rne_bf16(h * rstd2 * wq, ROUND_BF16)
            tl.store(out_pre_ptr + row * stride_p + offs, p.to(out_pre_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for c0 in range(0, H, CHUNK):
            cols = c0 + offs
            b = tl.load(branch_ptr + row * stride_b + cols, mask=cols < H, other=0.0).to(tl.float32)
            acc += mul_rn(b, b, INTERPRET)
        rstd = tl.math.rsqrt(mul_rn(tl.sum(acc, axis=0), inv_h, INTERPRET) + eps)
        tl.store(rstd_post_ptr + row, rstd)
        acc2 = tl.zeros([CHUNK], dtype=tl.float32)
        for c0 in range(0, H, CHUNK):
            cols = c0 + offs
            m = cols < H
            h = _residual_chunk(branch_ptr, residual_ptr, post_w_ptr, row, stride_b, stride_r, cols, m, rstd,
                                s_branch, s_res, ROUND_BF16)
            tl.store(out_res_ptr + row * stride_o + cols, h.to(out_res_ptr.dtype.element_ty), mask=m)
            acc2 += mul_rn(h, h, INTERPRET)
        if HAS_PRE:
            rstd2 = tl.math.rsqrt(mul_rn(tl.sum(acc2, axis=0), inv_h, INTERPRET) + eps)
            tl.store(rstd_pre_ptr + row, rstd2)
            for c0 in range(0, H, CHUNK):
                cols = c0 + offs
                m = cols < H
                wq = tl.load(pre_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
                h = _residual_chunk(branch_ptr, residual_ptr, post_w_ptr, row, stride_b, stride_r, cols, m, rstd,
                                    s_branch, s_res, ROUND_BF16)
                p = rne_bf16(h * rstd2 * wq, ROUND_BF16)
                tl.store(out_pre_ptr + row * stride_p + cols, p.to(out_pre_ptr.dtype.element_ty), mask=m)


@triton.jit
def _piece_weights(post_w_ptr, pre_w_ptr, ca, cb, ma, mb, BA: tl.constexpr, BB: tl.constexpr, HAS_PRE: tl.constexpr):
    """Both norm weights in FP32 as the row's two pieces (the pre-norm's are zeros without one)."""
    wpa = tl.load(post_w_ptr + ca, mask=ma, other=0.0).to(tl.float32)
    wpb = tl.load(post_w_ptr + cb, mask=mb, other=0.0).to(tl.float32)
    wqa = tl.zeros([BA], dtype=tl.float32)
    wqb = tl.zeros([BB], dtype=tl.float32)
    if HAS_PRE:
        wqa = tl.load(pre_w_ptr + ca, mask=ma, other=0.0).to(tl.float32)
        wqb = tl.load(pre_w_ptr + cb, mask=mb, other=0.0).to(tl.float32)
    return wpa, wpb, wqa, wqb


@triton.jit
def _fwd_staged_kernel(branch_ptr, residual_ptr, post_w_ptr, pre_w_ptr, out_res_ptr, out_pre_ptr, rstd_post_ptr,
                       rstd_pre_ptr, stride_b, stride_r, stride_o, stride_p, T, H, inv_h, eps, s_branch, s_res,
                       HAS_PRE: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, STAGES: tl.constexpr,
                       ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    # A few programs per SM walk rows; each holds the norm weights once and the row as two power-of-two pieces
    # (no masked lanes at 5120 = 4096 + 1024), and the pipelined loop stages the next rows' loads in shared
    # memory, as the backward kernel does.
    inv_h = tl.cast(inv_h, tl.float32)
    eps = tl.cast(eps, tl.float32)
    s_branch = tl.cast(s_branch, tl.float32)
    s_res = tl.cast(s_res, tl.float32)
    ca = tl.arange(0, BA)
    cb = BA + tl.arange(0, BB)
    ma = ca < H
    mb = cb < H
    wpa, wpb, wqa, wqb = _piece_weights(post_w_ptr, pre_w_ptr, ca, cb, ma, mb, BA, BB, HAS_PRE)
    for row in tl.range(tl.program_id(0), T, tl.num_programs(0), num_stages=STAGES):
        r64 = tl.cast(row, tl.int64)  # (an int under the interpreter)
        ba = tl.load(branch_ptr + r64 * stride_b + ca, mask=ma, other=0.0).to(tl.float32)
        bb = tl.load(branch_ptr + r64 * stride_b + cb, mask=mb, other=0.0).to(tl.float32)
        ra = tl.load(residual_ptr + r64 * stride_r + ca, mask=ma, other=0.0).to(tl.float32)
        rb = tl.load(residual_ptr + r64 * stride_r + cb, mask=mb, other=0.0).to(tl.float32)
        ss = tl.sum(mul_rn(ba, ba, INTERPRET), axis=0) + tl.sum(mul_rn(bb, bb, INTERPRET), axis=0)
        rstd = tl.math.rsqrt(mul_rn(ss, inv_h, INTERPRET) + eps)
        tl.store(rstd_post_ptr + r64, rstd)
        ha = _residual(ba, ra, wpa, rstd, s_branch, s_res, ROUND_BF16)
        hb = _residual(bb, rb, wpb, rstd, s_branch, s_res, ROUND_BF16)
        tl.store(out_res_ptr + r64 * stride_o + ca, ha.to(out_res_ptr.dtype.element_ty), mask=ma)
        tl.store(out_res_ptr + r64 * stride_o + cb, hb.to(out_res_ptr.dtype.element_ty), mask=mb)
        if HAS_PRE:
            ss2 = tl.sum(mul_rn(ha, ha, INTERPRET), axis=0) + tl.sum(mul_rn(hb, hb, INTERPRET), axis=0)
            rstd2 = tl.math.rsqrt(mul_rn(ss2, inv_h, INTERPRET) + eps)
            tl.store(rstd_pre_ptr + r64, rstd2)
            pa = rne_bf16(ha * rstd2 * wqa, ROUND_BF16)
            pb = rne_bf16(hb * rstd2 * wqb, ROUND_BF16)
            tl.store(out_pre_ptr + r64 * stride_p + ca, pa.to(out_pre_ptr.dtype.element_ty), mask=ma)
            tl.store(out_pre_ptr + r64 * stride_p + cb, pb.to(out_pre_ptr.dtype.element_ty), mask=mb)


@triton.jit
def _bwd_row_loads(branch_ptr, h_ptr, g_res_ptr, g_pre_ptr, row, T, H, cols, m, HAS_PRE_GRAD: tl.constexpr,
                   HAS_RES_GRAD: tl.constexpr):
    """One row's backward inputs in their storage dtype (branch, h', grad of h', grad of the pre-norm output)."""
    rm = m & (row < T)
    off = row * H + cols
    b = tl.load(branch_ptr + off, mask=rm, other=0.0)
    if HAS_RES_GRAD:
        gh = tl.load(g_res_ptr + off, mask=rm, other=0.0)
    else:
        gh = tl.zeros_like(b)
    if HAS_PRE_GRAD:
        h = tl.load(h_ptr + off, mask=rm, other=0.0)
        gp = tl.load(g_pre_ptr + off, mask=rm, other=0.0)
    else:
        h = tl.zeros_like(b)
        gp = tl.zeros_like(b)
    return b, h, gh, gp


@triton.jit
def _bwd_kernel(branch_ptr, h_ptr, g_res_ptr, g_pre_ptr, post_w_ptr, pre_w_ptr, rstd_post_ptr, rstd_pre_ptr,
                d_branch_ptr, d_res_ptr, dw_post_ptr, dw_pre_ptr, T, H, inv_h, s_branch, s_res, rows_per_prog,
                HAS_PRE_GRAD: tl.constexpr, HAS_RES_GRAD: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
                STAGES: tl.constexpr):
    # Each program walks rows_per_prog rows and keeps its FP32 weight-gradient partials in registers. The row is
    # held as two power-of-two pieces [0, BA) and [BA, BA + BB) (5120 = 4096 + 1024) rather than one
    # next-power-of-two block (8192, 37.5 % masked lanes, which sat at the register cap with spills), and the
    # pipelined loop (STAGES) stages the next rows' loads in shared memory (cp.async): more rows in flight than
    # the register file allows. Measured on the H200 (docs/benchmarks.md), fraction of copy bandwidth: one block
    # 0.55, pieces 0.57, pieces + the next row's loads issued by hand 0.68-0.73, pieces + 3 stages 0.88. Slower
    # and removed: a chunked multi-pass variant with the partials in L2, one combined reduction of four row sums,
    # the hand-written prefetch.
    inv_h = tl.cast(inv_h, tl.float32)
    s_branch = tl.cast(s_branch, tl.float32)
    s_res = tl.cast(s_res, tl.float32)
    pid = tl.program_id(0)
    ca = tl.arange(0, BA)
    cb = BA + tl.arange(0, BB)
    ma = ca < H
    mb = cb < H
    wpa, wpb, wqa, wqb = _piece_weights(post_w_ptr, pre_w_ptr, ca, cb, ma, mb, BA, BB, HAS_PRE_GRAD)
    apa = tl.zeros([BA], dtype=tl.float32)
    apb = tl.zeros([BB], dtype=tl.float32)
    aqa = tl.zeros([BA], dtype=tl.float32)
    aqb = tl.zeros([BB], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_prog
    for i in tl.range(0, rows_per_prog, num_stages=STAGES):
        row = first + i
        ba_, ha_, gha_, gpa_ = _bwd_row_loads(branch_ptr, h_ptr, g_res_ptr, g_pre_ptr, row, T, H, ca, ma,
                                              HAS_PRE_GRAD, HAS_RES_GRAD)
        bb_, hb_, ghb_, gpb_ = _bwd_row_loads(branch_ptr, h_ptr, g_res_ptr, g_pre_ptr, row, T, H, cb, mb,
                                              HAS_PRE_GRAD, HAS_RES_GRAD)
        gha = gha_.to(tl.float32)
        ghb = ghb_.to(tl.float32)
        if HAS_PRE_GRAD:
            rstd2 = tl.load(rstd_pre_ptr + row, mask=row < T, other=0.0)
            hha = ha_.to(tl.float32) * rstd2
            hhb = hb_.to(tl.float32) * rstd2
            gpa = gpa_.to(tl.float32)
            gpb = gpb_.to(tl.float32)
            gpwa = gpa * wqa
            gpwb = gpb * wqb
            c1 = (tl.sum(gpwa * hha, axis=0) + tl.sum(gpwb * hhb, axis=0)) * inv_h
            gha += rstd2 * (gpwa - hha * c1)
            ghb += rstd2 * (gpwb - hhb * c1)
            aqa += gpa * hha
            aqb += gpb * hhb
        rstd = tl.load(rstd_post_ptr + row, mask=row < T, other=0.0)
        bha = ba_.to(tl.float32) * rstd
        bhb = bb_.to(tl.float32) * rstd
        gna = gha * s_branch
        gnb = ghb * s_branch
        gnwa = gna * wpa
        gnwb = gnb * wpb
        c2 = (tl.sum(gnwa * bha, axis=0) + tl.sum(gnwb * bhb, axis=0)) * inv_h
        apa += gna * bha
        apb += gnb * bhb
        rok = row < T
        tl.store(d_branch_ptr + row * H + ca, (rstd * (gnwa - bha * c2)).to(d_branch_ptr.dtype.element_ty),
                 mask=ma & rok)
        tl.store(d_branch_ptr + row * H + cb, (rstd * (gnwb - bhb * c2)).to(d_branch_ptr.dtype.element_ty),
                 mask=mb & rok)
        tl.store(d_res_ptr + row * H + ca, (gha * s_res).to(d_res_ptr.dtype.element_ty), mask=ma & rok)
        tl.store(d_res_ptr + row * H + cb, (ghb * s_res).to(d_res_ptr.dtype.element_ty), mask=mb & rok)
    tl.store(dw_post_ptr + pid * H + ca, apa, mask=ma)
    tl.store(dw_post_ptr + pid * H + cb, apb, mask=mb)
    if HAS_PRE_GRAD:
        tl.store(dw_pre_ptr + pid * H + ca, aqa, mask=ma)
        tl.store(dw_pre_ptr + pid * H + cb, aqb, mask=mb)


def _split_blocks(h: int) -> tuple[int, int]:
    """The row as two power-of-two pieces: the largest power of two <= h, then the rest rounded up."""
    ba = 1 << (h.bit_length() - 1)
    return ba, (triton.next_power_of_2(h - ba) if h > ba else 1)


# Launch tuning (benchmarks/kernel_sweep.py times the choices on a GPU). A choice can change the order of FP32
# sums (the last bits of a few outputs and gradients), never a rounding point; the sweep checks each against the
# defaults.
# Forward layouts: "staged" (a few programs per SM walk rows through a pipelined loop; fwd_stages, fwd_per_sm,
# fwd_warps), "row" (one whole row per program; fwd_row_warps) and "chunked" (one row per program in fwd_chunk
# pieces, three passes; for rows too wide to hold; fwd_row_warps).
TUNING: dict = {"fwd_layout": "staged", "fwd_stages": 3, "fwd_per_sm": 4, "fwd_warps": 16, "fwd_row_warps": 8,
                "fwd_chunk": 1024, "bwd_warps": 8, "bwd_per_sm": 1, "bwd_stages": 3, "bwd_finish": "triton"}
_FWD_LAYOUTS = ("staged", "row", "chunked")


class _SandwichResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, branch, residual, post_w, pre_w, s_branch, s_res, eps):
        t, h = branch.shape
        has_pre = pre_w is not None
        out_res = torch.empty_like(branch)
        out_pre = torch.empty_like(branch) if has_pre else branch.new_empty(0)
        rstd_post = torch.empty(t, device=branch.device, dtype=torch.float32)
        rstd_pre = torch.empty(t if has_pre else 0, device=branch.device, dtype=torch.float32)
        layout = TUNING["fwd_layout"]
        if layout not in _FWD_LAYOUTS:
            raise ValueError(f"sandwich_residual.TUNING['fwd_layout'] must be one of {_FWD_LAYOUTS}, got {layout!r}")
        args = (branch, residual, post_w, pre_w if has_pre else post_w, out_res, out_pre, rstd_post, rstd_pre,
                branch.stride(0), residual.stride(0), out_res.stride(0), out_pre.stride(0) if has_pre else 0)
        if layout == "staged" and t:
            ba, bb = _split_blocks(h)
            progs = num_programs_for_reduction(branch.device, t, int(TUNING["fwd_per_sm"]))
            _fwd_staged_kernel[(progs,)](*args, t, h, 1.0 / h, eps, s_branch, s_res, HAS_PRE=has_pre, BA=ba, BB=bb,
                                         STAGES=int(TUNING["fwd_stages"]), num_warps=int(TUNING["fwd_warps"]),
                                         **kernel_flags(branch.dtype), **LAUNCH_OPTIONS)
        elif t:
            one_pass = layout == "row"
            chunk = triton.next_power_of_2(h) if one_pass else min(int(TUNING["fwd_chunk"]),
                                                                   triton.next_power_of_2(h))
            _fwd_kernel[(t,)](*args, h, 1.0 / h, eps, s_branch, s_res, HAS_PRE=has_pre, CHUNK=chunk,
                              ONE_PASS=one_pass, num_warps=int(TUNING["fwd_row_warps"]),
                              **kernel_flags(branch.dtype), **LAUNCH_OPTIONS)
        ctx.save_for_backward(branch, out_res, post_w, pre_w if has_pre else None, rstd_post, rstd_pre)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no zeros read
        ctx.scalars = (s_branch, s_res)
        ctx.has_pre = has_pre
        if not has_pre:
            ctx.mark_non_differentiable(out_pre)
        return out_res, out_pre

    @staticmethod
    def backward(ctx, g_res, g_pre):
        branch, out_res, post_w, pre_w, rstd_post, rstd_pre = ctx.saved_tensors
        s_branch, s_res = ctx.scalars
        t, h = branch.shape
        has_pre_grad = ctx.has_pre and g_pre is not None
        progs = num_programs_for_reduction(branch.device, t, int(TUNING["bwd_per_sm"]))
        rows_per_prog = triton.cdiv(t, progs)
        d_branch = torch.empty_like(branch)
        d_res = torch.empty_like(branch)
        n_w = 2 if has_pre_grad else 1
        dw = torch.empty(n_w * progs, h, device=branch.device, dtype=torch.float32)  # post rows, then pre rows
        g_res_c = g_res.contiguous() if g_res is not None else branch
        g_pre_c = g_pre.contiguous() if has_pre_grad else branch
        ba, bb = _split_blocks(h)
        _bwd_kernel[(progs,)](
            branch, out_res, g_res_c, g_pre_c, post_w, pre_w if has_pre_grad else post_w, rstd_post,
            rstd_pre if has_pre_grad else rstd_post, d_branch, d_res, dw, dw[progs:] if has_pre_grad else dw,
            t, h, 1.0 / h, s_branch, s_res, rows_per_prog, HAS_PRE_GRAD=has_pre_grad, HAS_RES_GRAD=g_res is not None,
            BA=ba, BB=bb, STAGES=int(TUNING["bwd_stages"]),
            num_warps=int(TUNING["bwd_warps"]))
        dtypes = (post_w.dtype, pre_w.dtype) if has_pre_grad else (post_w.dtype,)
        grads = weight_gradients(dw, (progs,) * n_w, dtypes, TUNING["bwd_finish"])
        d_post_w = grads[0]
        d_pre_w = None
        if ctx.has_pre:
            d_pre_w = grads[1] if has_pre_grad else torch.zeros_like(pre_w)
        return d_branch, d_res, d_post_w, d_pre_w, None, None, None


def fused_post_norm_residual_pre_norm(branch: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                                      pre_weight: Optional[torch.Tensor], scales: tuple[float, float],
                                      eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Triton implementation of `ops.post_norm_residual_pre_norm` (same contract, custom backward)."""
    if branch.shape != residual.shape or branch.dtype != residual.dtype:
        raise ValueError(f"post_norm_residual_pre_norm: branch {tuple(branch.shape)} {branch.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must match (the residual stream is BF16)")
    shape = branch.shape
    hidden = shape[-1]
    b2 = branch.reshape(-1, hidden).contiguous()
    r2 = residual.reshape(-1, hidden).contiguous()
    new_res, pre = _SandwichResidual.apply(b2, r2, post_weight.contiguous(),
                                           pre_weight.contiguous() if pre_weight is not None else None,
                                           float(scales[0]), float(scales[1]), float(eps))
    return new_res.view(shape), (pre.view(shape) if pre_weight is not None else None)


def _rms_norm_backward(x, rstd, grad_y, weight):
    """d/dx and d/dw of `x * rstd * w` (rstd = rsqrt(mean(x^2)+eps)), rows on the last dim."""
    xh = x * rstd
    gw = grad_y * weight
    dx = rstd * (gw - xh * (gw * xh).mean(dim=-1, keepdim=True))
    return dx, (grad_y * xh).reshape(-1, x.shape[-1]).sum(0)


def backward_reference(branch, residual, post_w, pre_w, scales, eps, g_res, g_pre):
    """The kernel's backward math in plain torch (any dtype; float64 in tests). Returns (d_branch, d_residual,
    d_post_w, d_pre_w). Roundings are identity, as in autograd."""
    s_b, s_r = scales
    rstd = torch.rsqrt(branch.pow(2).mean(-1, keepdim=True) + eps)
    n = branch * rstd * post_w
    h = n * s_b + residual * s_r
    gh = g_res if g_res is not None else torch.zeros_like(h)
    d_pre_w = None
    if pre_w is not None and g_pre is not None:
        rstd2 = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        dh, d_pre_w = _rms_norm_backward(h, rstd2, g_pre, pre_w)
        gh = gh + dh
    d_branch, d_post_w = _rms_norm_backward(branch, rstd, gh * s_b, post_w)
    return d_branch, gh * s_r, d_post_w, d_pre_w
