"""Fused per-head Q/K RMSNorm + FP32 NeoX RoPE (sliding layers) or + SSMax (full layers) (§3.3-3.5).

One launch handles q [T, Hq, D] and k [T, Hkv, D] together (any token/head strides, e.g. views of a fused QKV
projection): a program takes a few tokens, loads each token's FP32 cos/sin (or SSMax scale) once for all of its
heads, and reads each [head_dim] row once and writes it once, contiguous:

    n = bf16(fp32(x) * rstd(x) * fp32(w))                       # QK-norm, one rounding
    RoPE:  out = bf16([n1*cos - n2*sin, n2*cos + n1*sin])       # FP32 cos/sin [T, D/2], one rounding
    SSMax: out = bf16(fp32(n) * s(p))                           # q only; FP32 scale [T]

The backward kernel (also one launch) recomputes rstd from x and rotates/scales the gradient back; the norm-weight
gradients are summed from per-program FP32 partials. `backward_reference` is the same math in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import LAUNCH_OPTIONS, kernel_flags, mul_rn, rne_bf16
from beamrl.kernels.partial_sums import weight_gradients

MODE_NORM, MODE_ROPE, MODE_SSMAX = 0, 1, 2

# Launch tuning (benchmarks/kernel_sweep.py times the choices on a GPU). A choice can change the order of FP32
# sums (the last bits of a few outputs and gradients), never a rounding point; the sweep checks each against the
# defaults.
TUNING: dict = {"fwd_tokens": 1, "fwd_warps": 4, "bwd_tokens": 64, "bwd_warps": 4, "bwd_heads": 16, "bwd_stages": 3,
                "bwd_finish": "triton"}


def _bwd_token_tile(tokens: int, blocks: int, device: torch.device) -> int:
    """TUNING's token tile, halved (not below 8) while the grid would give an SM fewer than 3 programs: short
    micro-batches keep the GPU full, long ones keep few weight-gradient partials."""
    tb = int(TUNING["bwd_tokens"])
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        while tb > 8 and triton.cdiv(tokens, tb) * blocks < 3 * sms:
            tb //= 2
    return tb


@triton.jit
def _fwd_rows(x_ptr, out_ptr, w1, w2, t, h0, stride_t, stride_h, co, si, sc, inv_d, eps, HEADS: tl.constexpr,
              MODE: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, ROUND_BF16: tl.constexpr,
              INTERPRET: tl.constexpr):
    hd = h0 + tl.arange(0, HB)
    c = tl.arange(0, HALF)
    src = t * stride_t + (hd * stride_h)[:, None] + c[None, :]
    x1 = tl.load(x_ptr + src).to(tl.float32)
    x2 = tl.load(x_ptr + src + HALF).to(tl.float32)
    ss = tl.sum(mul_rn(x1, x1, INTERPRET), axis=1) + tl.sum(mul_rn(x2, x2, INTERPRET), axis=1)
    rstd = tl.math.rsqrt(mul_rn(ss, inv_d, INTERPRET) + eps)[:, None]
    n1 = rne_bf16(x1 * rstd * w1, ROUND_BF16)
    n2 = rne_bf16(x2 * rstd * w2, ROUND_BF16)
    if MODE == 1:
        o1 = rne_bf16(mul_rn(n1, co, INTERPRET) - mul_rn(n2, si, INTERPRET), ROUND_BF16)
        o2 = rne_bf16(mul_rn(n2, co, INTERPRET) + mul_rn(n1, si, INTERPRET), ROUND_BF16)
    elif MODE == 2:
        o1 = rne_bf16(n1 * sc, ROUND_BF16)
        o2 = rne_bf16(n2 * sc, ROUND_BF16)
    else:
        o1 = n1
        o2 = n2
    dst = (t * HEADS + hd)[:, None] * (2 * HALF) + c[None, :]
    tl.store(out_ptr + dst, o1.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + dst + HALF, o2.to(out_ptr.dtype.element_ty))


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, scale_ptr, qo_ptr, ko_ptr, T, sq_t, sq_h, sk_t,
                sk_h, inv_d, eps, HQ: tl.constexpr, HK: tl.constexpr, MODE_Q: tl.constexpr, MODE_K: tl.constexpr,
                HALF: tl.constexpr, HBQ: tl.constexpr, HBK: tl.constexpr, TB: tl.constexpr,
                ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    inv_d = tl.cast(inv_d, tl.float32)
    eps = tl.cast(eps, tl.float32)
    c = tl.arange(0, HALF)
    wq1 = tl.load(wq_ptr + c).to(tl.float32)[None, :]
    wq2 = tl.load(wq_ptr + HALF + c).to(tl.float32)[None, :]
    wk1 = tl.load(wk_ptr + c).to(tl.float32)[None, :]
    wk2 = tl.load(wk_ptr + HALF + c).to(tl.float32)[None, :]
    for i in range(TB):
        t = tl.program_id(0).to(tl.int64) * TB + i
        if t < T:
            co = tl.zeros([1, HALF], dtype=tl.float32)
            si = tl.zeros([1, HALF], dtype=tl.float32)
            sc = tl.cast(1.0, tl.float32)
            if MODE_Q == 1 or MODE_K == 1:
                co = tl.load(cos_ptr + t * HALF + c)[None, :]
                si = tl.load(sin_ptr + t * HALF + c)[None, :]
            if MODE_Q == 2 or MODE_K == 2:
                sc = tl.load(scale_ptr + t)
            for hb in tl.static_range(HQ // HBQ):
                _fwd_rows(q_ptr, qo_ptr, wq1, wq2, t, hb * HBQ, sq_t, sq_h, co, si, sc, inv_d, eps, HQ, MODE_Q, HALF,
                          HBQ, ROUND_BF16, INTERPRET)
            for hb in tl.static_range(HK // HBK):
                _fwd_rows(k_ptr, ko_ptr, wk1, wk2, t, hb * HBK, sk_t, sk_h, co, si, sc, inv_d, eps, HK, MODE_K, HALF,
                          HBK, ROUND_BF16, INTERPRET)


@triton.jit
def _bwd_rows(x_ptr, go_ptr, dx_ptr, w1, w2, t, ok, h0, stride_t, stride_h, co, si, sc, inv_d, eps,
              HEADS: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr):
    """dx of one [HB, D] block (stored where `ok`, i.e. t < T; t itself is always a valid token) and its
    per-element norm-weight gradient terms [HB, D/2] x 2, zero unless `ok` (summed over heads by the caller once
    per program: a cross-warp reduction per token measured 2x slower)."""
    hd = h0 + tl.arange(0, HB)
    c = tl.arange(0, HALF)
    src = t * stride_t + (hd * stride_h)[:, None] + c[None, :]
    x1 = tl.load(x_ptr + src).to(tl.float32)
    x2 = tl.load(x_ptr + src + HALF).to(tl.float32)
    dst = (t * HEADS + hd)[:, None] * (2 * HALF) + c[None, :]
    g1 = tl.load(go_ptr + dst).to(tl.float32)
    g2 = tl.load(go_ptr + dst + HALF).to(tl.float32)
    if MODE == 1:
        gn1 = g1 * co + g2 * si
        gn2 = g2 * co - g1 * si
    elif MODE == 2:
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
    sm = (hd < HEADS)[:, None] & ok  # [HB, 1]: every head of the block, only for a real token
    tl.store(dx_ptr + dst, (rstd * (gw1 - xh1 * dot)).to(dx_ptr.dtype.element_ty), mask=sm)
    tl.store(dx_ptr + dst + HALF, (rstd * (gw2 - xh2 * dot)).to(dx_ptr.dtype.element_ty), mask=sm)
    return tl.where(ok, gn1 * xh1, 0.0), tl.where(ok, gn2 * xh2, 0.0)


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, scale_ptr, gq_ptr, gk_ptr, dq_ptr, dk_ptr, dw_ptr,
                T, sq_t, sq_h, sk_t, sk_h, inv_d, eps, HQ: tl.constexpr, HK: tl.constexpr, MODE_Q: tl.constexpr,
                MODE_K: tl.constexpr, HALF: tl.constexpr, HBQ: tl.constexpr, HBK: tl.constexpr,
                TB: tl.constexpr, STAGES: tl.constexpr):
    # Grid (token tiles, head blocks): program (i, j) handles TB tokens of q's head block j (j < HQ/HBQ) or of
    # k's block j - HQ/HBQ, and writes its norm-weight gradient partial to dw [blocks, tiles, D] (FP32, summed
    # by partial_sums). The token loop is pipelined (STAGES). Fraction of copy bandwidth on the H200
    # (docs/benchmarks.md): 0.84-0.85 with 64-token tiles and 3 stages; 0.65-0.66 with 8-token tiles unstaged;
    # slower and removed: the forward's layout, all head blocks of a token per program (0.48-0.54).
    inv_d = tl.cast(inv_d, tl.float32)
    eps = tl.cast(eps, tl.float32)
    pid_t = tl.program_id(0)
    blk = tl.program_id(1)
    c = tl.arange(0, HALF)
    is_q = blk < HQ // HBQ
    if is_q:
        w1 = tl.load(wq_ptr + c).to(tl.float32)[None, :]
        w2 = tl.load(wq_ptr + HALF + c).to(tl.float32)[None, :]
    else:
        w1 = tl.load(wk_ptr + c).to(tl.float32)[None, :]
        w2 = tl.load(wk_ptr + HALF + c).to(tl.float32)[None, :]
    if is_q:
        a1, a2 = _bwd_tokens(q_ptr, gq_ptr, dq_ptr, w1, w2, cos_ptr, sin_ptr, scale_ptr, pid_t, blk * HBQ, T, sq_t,
                             sq_h, inv_d, eps, HQ, MODE_Q, HALF, HBQ, TB, STAGES)
    else:
        a1, a2 = _bwd_tokens(k_ptr, gk_ptr, dk_ptr, w1, w2, cos_ptr, sin_ptr, scale_ptr, pid_t,
                             (blk - HQ // HBQ) * HBK, T, sk_t, sk_h, inv_d, eps, HK, MODE_K, HALF, HBK, TB, STAGES)
    base = dw_ptr + (blk * tl.num_programs(0) + pid_t) * (2 * HALF)  # [blocks, tiles, D]: q rows, then k rows
    tl.store(base + c, a1)
    tl.store(base + HALF + c, a2)


@triton.jit
def _bwd_tokens(x_ptr, go_ptr, dx_ptr, w1, w2, cos_ptr, sin_ptr, scale_ptr, pid_t, h0, T, stride_t, stride_h, inv_d,
                eps, HEADS: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
                TB: tl.constexpr, STAGES: tl.constexpr):
    """TB tokens of one head block; returns the block's norm-weight gradient partial (two [HALF] halves)."""
    c = tl.arange(0, HALF)
    a1 = tl.zeros([HB, HALF], dtype=tl.float32)
    a2 = tl.zeros([HB, HALF], dtype=tl.float32)
    # No branch on t < T: the last tile's missing tokens re-read token T - 1 and store nothing, so the loop body
    # is straight-line and Triton's pipeliner can stage the next tokens' loads (STAGES > 1).
    for i in tl.range(0, TB, num_stages=STAGES):
        t_raw = pid_t.to(tl.int64) * TB + i
        ok = t_raw < T
        t = tl.minimum(t_raw, T - 1)
        co = tl.zeros([1, HALF], dtype=tl.float32)
        si = tl.zeros([1, HALF], dtype=tl.float32)
        sc = tl.cast(1.0, tl.float32)
        if MODE == 1:
            co = tl.load(cos_ptr + t * HALF + c)[None, :]
            si = tl.load(sin_ptr + t * HALF + c)[None, :]
        if MODE == 2:
            sc = tl.load(scale_ptr + t)
        p1, p2 = _bwd_rows(x_ptr, go_ptr, dx_ptr, w1, w2, t, ok, h0, stride_t, stride_h, co, si, sc, inv_d, eps,
                           HEADS, MODE, HALF, HB)
        a1 += p1
        a2 += p2
    return tl.sum(a1, axis=0), tl.sum(a2, axis=0)


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, heads, head_dim] with a unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    d = x.shape[-1]
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"{name}: head_dim must be twice a power of two for this kernel, got {d}")


def _heads_per_block(heads: int, cap: int = 16) -> int:
    """The largest power of two (at most `cap`) dividing the head count: blocks need no head mask."""
    return min(cap, heads & -heads)


def _optional_inputs(cos, sin, scale, dummy):
    """cos, sin, scale with a dummy pointer for the ones this mode does not read."""
    return tuple(x if x is not None else dummy for x in (cos, sin, scale))


class _QKNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, wq, wk, cos, sin, scale, eps, mode_q, mode_k):
        t, hq, d = q.shape
        hk = k.shape[1]
        qo = torch.empty((t, hq, d), device=q.device, dtype=q.dtype)
        ko = torch.empty((t, hk, d), device=k.device, dtype=k.dtype)
        tb = int(TUNING["fwd_tokens"])
        if t:
            _fwd_kernel[(triton.cdiv(t, tb),)](
                q, k, wq, wk, *_optional_inputs(cos, sin, scale, wq), qo, ko, t, q.stride(0),
                q.stride(1), k.stride(0), k.stride(1), 1.0 / d, eps, HQ=hq, HK=hk, MODE_Q=mode_q, MODE_K=mode_k,
                HALF=d // 2, HBQ=_heads_per_block(hq), HBK=_heads_per_block(hk), TB=tb,
                num_warps=int(TUNING["fwd_warps"]), **kernel_flags(q.dtype), **LAUNCH_OPTIONS)
        ctx.save_for_backward(q, k, wq, wk, cos, sin, scale)
        ctx.eps, ctx.modes = eps, (mode_q, mode_k)
        return qo, ko

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, wq, wk, cos, sin, scale = ctx.saved_tensors
        mode_q, mode_k = ctx.modes
        t, hq, d = q.shape
        hk = k.shape[1]
        cap = int(TUNING["bwd_heads"])
        hbq, hbk = _heads_per_block(hq, cap), _heads_per_block(hk, cap)
        nq = hq // hbq
        nk = hk // hbk
        tb = _bwd_token_tile(t, nq + nk, q.device)
        tiles = triton.cdiv(t, tb)
        dq = torch.empty((t, hq, d), device=q.device, dtype=q.dtype)
        dk = torch.empty((t, hk, d), device=k.device, dtype=k.dtype)
        dw = torch.empty((nq + nk) * tiles, d, device=q.device, dtype=torch.float32)  # every row is written
        gq = gq.contiguous() if gq is not None else torch.zeros_like(dq)
        gk = gk.contiguous() if gk is not None else torch.zeros_like(dk)
        if t:
            _bwd_kernel[(tiles, nq + nk)](
                q, k, wq, wk, *_optional_inputs(cos, sin, scale, wq), gq, gk, dq, dk, dw, t,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), 1.0 / d, ctx.eps, HQ=hq, HK=hk, MODE_Q=mode_q,
                MODE_K=mode_k, HALF=d // 2, HBQ=hbq, HBK=hbk, TB=tb, STAGES=int(TUNING["bwd_stages"]),
                num_warps=int(TUNING["bwd_warps"]))
        dwq, dwk = weight_gradients(dw, (nq * tiles, nk * tiles), (wq.dtype, wk.dtype), TUNING["bwd_finish"])
        return dq, dk, dwq, dwk, None, None, None, None, None, None


def _qk_norm_pair(q, k, q_weight, k_weight, eps, mode_q, mode_k, cos=None, sin=None, scale=None):
    _check(q, "q")
    _check(k, "k")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and head_dim")
    if k.dtype != q.dtype:  # one launch rounds both as q's dtype says
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must have the same dtype")
    if MODE_ROPE in (mode_q, mode_k):
        for name, v in (("cos", cos), ("sin", sin)):
            if v is None or v.shape != (t, d // 2) or v.dtype != torch.float32:
                raise ValueError(f"qk_norm_rope: {name} must be FP32 [{t}, {d // 2}], got "
                                 f"{None if v is None else (tuple(v.shape), v.dtype)}")
        cos, sin = cos.contiguous(), sin.contiguous()
    if MODE_SSMAX in (mode_q, mode_k):
        if scale is None or scale.shape != (t,) or scale.dtype != torch.float32:
            raise ValueError(f"qk_norm_ssmax: scale must be FP32 [{t}], got "
                             f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")
        scale = scale.contiguous()
    return _QKNorm.apply(q, k, q_weight.contiguous(), k_weight.contiguous(), cos, sin, scale, float(eps), mode_q,
                         mode_k)


def fused_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    """Triton implementation of `ops.qk_norm_rope` (q and k in one launch)."""
    return _qk_norm_pair(q, k, q_weight, k_weight, eps, MODE_ROPE, MODE_ROPE, cos=cos, sin=sin)


def fused_qk_norm_ssmax(q, k, q_weight, k_weight, scale, eps):
    """Triton implementation of `ops.qk_norm_ssmax` (SSMax on q only; q and k in one launch)."""
    return _qk_norm_pair(q, k, q_weight, k_weight, eps, MODE_SSMAX, MODE_NORM, scale=scale)


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
