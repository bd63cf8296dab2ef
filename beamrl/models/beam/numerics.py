"""Beam's numeric rules as small eager functions, with SGLang's GPU rounding points (beam-numerics.md §3).

Every Beam implementation in beamrl (reference model, Megatron modules on CPU, the eager references of the
Triton kernels) calls these, so a rule lives in exactly one place. Each function rounds to the dtype of its
activation input where the contract rounds; in float32 every rounding is the identity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SSMAX_BASE = 2048.0
SSMAX_EXPONENT = 0.1
RENORM_EPS = 1e-20


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf16(fp32(x) * rsqrt(mean(fp32(x)^2) + eps) * fp32(w))`: one rounding, weight used as stored (§3.2)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """FP32 inverse frequencies `1 / theta^(2j/d)` of NeoX split-half RoPE (rotary_dim = head_dim)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta ** exponent)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin of shape [..., head_dim/2] for integer positions (§3.4; SGLang keeps the cache in FP32)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * rope_inv_freq(head_dim, theta, positions.device)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., heads, head_dim] in FP32 (NeoX split-half) and round once. cos/sin: [..., head_dim/2]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def ssmax_scale(positions: torch.Tensor) -> torch.Tensor:
    """`exp(0.1 * log1p((p + 1) / 2048))` in FP32 from 0-based positions within each sequence (§3.5)."""
    return torch.exp(SSMAX_EXPONENT * torch.log1p((positions.float() + 1) / SSMAX_BASE))


def apply_ssmax(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`bf16(fp32(q) * s(p))` for q [..., heads, head_dim] and scale [...] (one rounding; q only)."""
    return (q.float() * scale.unsqueeze(-1).unsqueeze(-1)).to(q.dtype)


def output_gate(o: torch.Tensor, g: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`bf16(o * bf16(sigmoid(bf16(g + b_h))))` per head (§3.7): three roundings.

    o, g: [..., heads, head_dim]; bias: [heads]. Each op runs on tensors of o's dtype, so PyTorch computes it
    in FP32 and rounds once per op, which is exactly the contract's three roundings."""
    b = bias.to(g.dtype).unsqueeze(-1)
    return o * torch.sigmoid(g + b)


def depth_scaled_residual(branch: torch.Tensor, residual: torch.Tensor, scales: tuple[float, float]) -> torch.Tensor:
    """`bf16(bf16(x * s_b) + bf16(h * s_r))` (§3.8): both scaled operands rounded, then the add rounded.

    `scales` are Python floats from `BeamConfig.residual_scales` (SGLang's `math.sqrt` values)."""
    branch_scale, residual_scale = scales
    residual = residual.to(branch.dtype)
    return branch * branch_scale + residual * residual_scale


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`bf16(silu(fp32 gate) * fp32 up)`: the GPU path's single rounding (§3.9; the CPU engine rounds twice)."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """FP32 router logits `fp32(x) @ W^T` with the FP32 router weight (§3.10.1)."""
    return torch.matmul(x.float(), weight.float().t())


def grouped_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                 topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped sigmoid routing as SGLang's `biased_grouped_topk_impl` (topk.py:1780-1862).

    Select on `sigmoid(z) + bias`: group score = sum of the top-2 biased scores per group, keep `topk_group`
    groups, take the top-k experts among them. Weights are the *unbiased* sigmoid scores renormalised as
    `w / (sum w + 1e-20)` in FP32. Returns (weights fp32 [T, k], ids int64 [T, k]); the 2.5 scale is not here.
    """
    scores = torch.sigmoid(logits.float())
    t, e = scores.shape
    choice = scores + correction_bias.float().view(1, e)
    group_scores = choice.view(t, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)  # [T, n_group]
    # -inf on every expert of a dropped group, through a broadcast [T, n_group, 1] mask (no [T, E] mask copy)
    masked = choice.view(t, n_group, -1).masked_fill(dropped.unsqueeze(-1), float("-inf")).view(t, e)
    ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)[1]
    return routing_weights(scores, ids), ids


def routing_weights(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Renormalised FP32 weights of the chosen experts from the live sigmoid scores (also used for replay)."""
    w = scores.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True, dtype=torch.float32) + RENORM_EPS)


def expert_output(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
    """One expert for its tokens: `bf16(w * acc_fp32(down(bf16(silu(g) * u))))` (§3.10.7).

    The routing weight multiplies the FP32 accumulator of the down GEMM before its single rounding, as the
    fused MoE kernel's epilogue does. weight: FP32 [tokens]."""
    act = swiglu(F.linear(x, gate_w), F.linear(x, up_w))
    acc = torch.matmul(act.float(), down_w.float().t())
    return (acc * weight.float().unsqueeze(-1)).to(x.dtype)


def grouped_expert_outputs(x: torch.Tensor, sizes: list[int], gate_up_w: torch.Tensor, down_w: torch.Tensor,
                           weight: torch.Tensor) -> torch.Tensor:
    """`expert_output` of every expert on its contiguous rows: x [N, H] sorted by expert, `sizes[e]` rows for
    expert e; gate_up_w [E, 2I, H] (gate rows, then up rows), down_w [E, H, I] (views are fine); weight FP32
    [N]. Returns [N, H].

    On CPU the GEMMs run as `torch._grouped_mm` over all experts at once (gate and up as one GEMM,
    `_GateUpGroupedMM`): the same per-expert products bit for bit, forward and backward
    (tests/models/beam/test_numerics.py checks it against the loop), in 2 ops instead of ~10 per expert. The CPU
    fallback of `_grouped_mm` still runs one GEMM per expert inside (about 13 aten ops and a host read each), so
    every grouped GEMM saved matters. Elsewhere (the GPU reference path) experts run one by one."""
    if not any(sizes):
        return x.new_zeros(0, x.shape[1])
    inter = gate_up_w.shape[1] // 2
    if x.device.type != "cpu" or not hasattr(torch, "_grouped_mm"):
        rows = x.split(sizes)
        ws = weight.split(sizes)
        return torch.cat([expert_output(rows[e], gate_up_w[e, :inter], gate_up_w[e, inter:], down_w[e], ws[e])
                          for e, n in enumerate(sizes) if n])
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    gate, up = _GateUpGroupedMM.apply(x, gate_up_w, offs)
    if silu_rounds_per_row(gate):
        act = swiglu(gate, up)  # one SiLU over all experts' rows: the same roundings as the per-expert calls
    else:
        # SiLU per expert, as the loop: ATen computes a tensor's last (numel mod 2 vector widths) elements with
        # the scalar exp and the rest with the vector one, so one SiLU over all rows would round some elements
        # differently (measured), while the GEMMs above equal the per-expert ones. Contiguous copies: on the
        # strided halves each row would have a scalar tail of its own.
        gate, up = gate.contiguous().split(sizes), up.contiguous().split(sizes)
        act = torch.cat([swiglu(gate[e], up[e]) for e, n in enumerate(sizes) if n])
    acc = torch._grouped_mm(act.float(), down_w.float().transpose(-2, -1), offs=offs)
    return (acc * weight.float().unsqueeze(-1)).to(x.dtype)


class _GateUpGroupedMM(torch.autograd.Function):
    """`x @ [gate; up]^T` per expert as one CPU `torch._grouped_mm` [N, 2I] instead of one for gate and one for up
    (the per-expert products are the same bit for bit: only the GEMM's N grows); returns the gate and up halves
    (views). Autograd's own backward of the merged GEMM would sum x's gradient over all 2I columns at once; this one
    computes it as the two separate GEMMs' gradients added, as autograd accumulated them before, and the weight
    gradient with one GEMM (each element the same dot product over the expert's rows). The halves' gradients are
    joined by one `cat` plus 0 (autograd joined the slices' zero-padded gradients by addition, which turns -0
    into +0) instead of two zero-filled [N, 2I] buffers and their sum."""

    @staticmethod
    def forward(ctx, x, gate_up_w, offs):
        ctx.save_for_backward(x, gate_up_w, offs)
        gate_up = torch._grouped_mm(x, gate_up_w.transpose(-2, -1), offs=offs)
        inter = gate_up_w.shape[1] // 2
        return gate_up[:, :inter], gate_up[:, inter:]

    @staticmethod
    def backward(ctx, grad_gate, grad_up):
        x, w, offs = ctx.saved_tensors
        inter = w.shape[1] // 2
        halves = [g if g is not None else x.new_zeros(x.shape[0], inter) for g in (grad_gate, grad_up)]
        grad = torch.cat(halves, dim=1).add_(0.0)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (torch._grouped_mm(grad[:, :inter], w[:, :inter], offs=offs)
                  + torch._grouped_mm(grad[:, inter:], w[:, inter:], offs=offs))
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(x.t(), grad, offs=offs).transpose(-2, -1)
        return dx, dw, None


# ATen's CPU elementwise loops run 2 vectors of 8 (AVX2) or 16 (AVX512) floats per iteration and the last
# `numel mod 2 vectors` elements with the scalar function; 32 covers both (and the 8-float generic vector).
SILU_VECTOR_BLOCK = 32
# at::internal::GRAIN_SIZE: above it a multi-threaded elementwise op splits its range at thread-count-dependent
# offsets, each chunk with its own scalar tail.
ATEN_GRAIN_SIZE = 32768


def silu_rounds_per_row(gate: torch.Tensor) -> bool:
    """True when one SiLU (and its backward) over the CPU tensor gate [N, I] (rows contiguous) rounds every element
    as SiLU over contiguous copies of any split of its rows would: every row starts and ends on a vector block (I
    is a multiple of `SILU_VECTOR_BLOCK`), so no element falls in a scalar tail, and the op runs as one range (one
    thread, or small enough not to be split)."""
    return (gate.dim() == 2 and gate.stride(-1) == 1 and gate.shape[1] % SILU_VECTOR_BLOCK == 0
            and (torch.get_num_threads() == 1 or gate.numel() <= ATEN_GRAIN_SIZE))


def moe_combine(per_expert: torch.Tensor, scaling: float) -> torch.Tensor:
    """`bf16(scaling * sum_k fp32(y_k))` over per_expert [T, k, H] (§3.10.8): the 2.5 scale, applied once."""
    return (per_expert.float().sum(dim=1) * scaling).to(per_expert.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(fp32(logits) / cap)` in FP32 (§3.11); None disables the cap (still FP32)."""
    lf = logits.float()
    return lf if cap is None else torch.tanh(lf / cap) * cap


def sliding_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [..., q, k] visibility: causal, and with a window key j is visible iff i - (window-1) <= j <= i (§3.6).

    q_pos [..., q] and k_pos [..., k] are absolute positions (optional shared leading batch dims)."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    visible = diff >= 0
    if window is not None:
        visible &= diff < window
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eager GQA attention, scale head_dim^-0.5, no logit cap. q [..., Tq, Hq, D], k/v [..., Tk, Hkv, D],
    mask [..., Tq, Tk] (optional leading batch dims, shared by q, k, v and mask).

    Scores and softmax in FP32, output rounded to q's dtype (the contract for what the GPU kernels compute;
    their tiling cannot be matched bit for bit, beam-numerics.md §6). A query row with no visible key yields NaN:
    callers must give every real query at least itself."""
    hq, hkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    rep = hq // hkv
    lead, tq, tk, n = q.shape[:-3], q.shape[-3], k.shape[-3], q.dim() - 3
    b = tuple(range(n))  # the leading batch dims
    # Query head h reads KV head h // rep: group the query heads instead of materialising repeated K/V.
    # The contractions "...qgrd,...kgd->...grqk" and "...grqk,...kgd->...qgrd" as the batched GEMMs that
    # torch.einsum runs for them (the same permutes, reshapes and bmm operand layouts, so the same bits forward
    # and backward; tests/models/beam/test_numerics.py), without einsum's ~25 extra view ops per call.
    qg = q.float().unflatten(-2, (hkv, rep)).permute(*b, n + 1, n + 2, n, n + 3)  # [..., Hkv, rep, Tq, D]
    kt = k.float().permute(*b, n + 1, n + 2, n)  # [..., Hkv, D, Tk]
    scores = torch.bmm(qg.reshape(-1, rep * tq, d), kt.reshape(-1, d, tk)).view(*lead, hkv, rep, tq, tk)
    scores = scores * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask.unsqueeze(-3).unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [..., Hkv, rep, Tq, Tk]
    pq = probs.permute(*b, n, n + 2, n + 1, n + 3).reshape(-1, tq * rep, tk)  # [B*Hkv, Tq*rep, Tk]
    vg = v.float().permute(*b, n + 1, n, n + 2).reshape(-1, tk, d)  # [B*Hkv, Tk, D]
    out = torch.bmm(pq, vg).view(*lead, hkv, tq, rep, d).permute(*b, n + 1, n, n + 2, n + 3)  # [..., Tq, Hkv, rep, D]
    return out.flatten(-3, -2).to(q.dtype)
