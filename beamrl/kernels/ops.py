"""Dispatch of Beam's fused trainer ops with an explicit backend (docs/kernels.md).

Every op has two implementations with the same semantics:

- ``backend="eager"``: a composition of `beamrl.models.beam.numerics` functions. This is the reference and
  what CPU always uses.
- ``backend="triton"``: the fused path. Elementwise/normalisation ops run hand-written Triton kernels with
  custom backward passes (bit-equal forward to eager in BF16, see docs/kernels.md for the few documented
  deviations); attention runs PyTorch FlexAttention with a document + sliding-window block mask
  (``"flex"`` is accepted as an alias); the MoE experts run `torch._grouped_mm`.

There is no silent fallback: asking for "triton" on a tensor the fast path cannot run raises.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from beamrl.models.beam import numerics

Backend = Literal["eager", "triton"]
AttentionBackend = Literal["eager", "flex", "triton"]

_BACKENDS = ("eager", "triton")
_ATTENTION_BACKENDS = ("eager", "flex", "triton")


class KernelBackendError(ValueError):
    """An op was asked for a backend it does not know, or that cannot run on the given tensors."""


def _check_backend(op: str, backend: str, allowed=_BACKENDS) -> None:
    if backend not in allowed:
        raise KernelBackendError(f"{op}: backend must be one of {allowed}, got {backend!r}")


def _check_triton_device(op: str, *tensors: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (tests)."""
    from beamrl.kernels._triton_utils import triton_interpret_enabled

    for t in tensors:
        if t is not None and t.device.type != "cuda" and not triton_interpret_enabled():
            raise KernelBackendError(
                f"{op}: backend='triton' needs CUDA tensors (got a tensor on {t.device}); "
                "use backend='eager' on CPU, or set TRITON_INTERPRET=1 before importing triton for tests")


# ----------------------------------------------------------------------------------------------------------------
# (a) sandwich post-norm -> depth-scaled residual -> next pre-norm


def post_norm_residual_pre_norm(branch: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                                pre_weight: Optional[torch.Tensor], scales: tuple[float, float], eps: float,
                                backend: Backend = "eager") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`h' = DSR(RMSNorm_post(branch), residual, scales)`, then `RMSNorm_pre(h')` for the next sublayer.

    branch, residual: [..., H] (same dtype); post_weight/pre_weight: [H]; scales = (branch_scale,
    residual_scale) from `BeamConfig.residual_scales`. pre_weight=None (e.g. the last layer's MLP step, whose
    next norm is the final norm handled elsewhere) returns None for the pre-normed output.
    Returns (new_residual, pre_normed)."""
    _check_backend("post_norm_residual_pre_norm", backend)
    if backend == "eager":
        normed = numerics.rms_norm(branch, post_weight, eps)
        new_residual = numerics.depth_scaled_residual(normed, residual, scales)
        pre = numerics.rms_norm(new_residual, pre_weight, eps) if pre_weight is not None else None
        return new_residual, pre
    _check_triton_device("post_norm_residual_pre_norm", branch, residual)
    from beamrl.kernels.sandwich_residual import fused_post_norm_residual_pre_norm

    return fused_post_norm_residual_pre_norm(branch, residual, post_weight, pre_weight, scales, eps)


# ----------------------------------------------------------------------------------------------------------------
# (b) Q/K RMSNorm + RoPE (sliding layers) and Q/K RMSNorm + SSMax (full layers)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 backend: Backend = "eager") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D], then FP32 NeoX RoPE with one rounding.

    cos, sin: FP32 [T, D/2] (`numerics.rope_cos_sin` of the within-sequence positions)."""
    _check_backend("qk_norm_rope", backend)
    if backend == "eager":
        qn = numerics.apply_rope(numerics.rms_norm(q, q_weight, eps), cos, sin)
        kn = numerics.apply_rope(numerics.rms_norm(k, k_weight, eps), cos, sin)
        return qn, kn
    _check_triton_device("qk_norm_rope", q, k)
    from beamrl.kernels.qk_norm import fused_qk_norm_rope

    return fused_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)


def qk_norm_ssmax(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  scale: torch.Tensor, eps: float,
                  backend: Backend = "eager") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then SSMax on q only: `bf16(fp32(q_normed) * s(p))`; scale FP32 [T]."""
    _check_backend("qk_norm_ssmax", backend)
    if backend == "eager":
        qn = numerics.apply_ssmax(numerics.rms_norm(q, q_weight, eps), scale)
        return qn, numerics.rms_norm(k, k_weight, eps)
    _check_triton_device("qk_norm_ssmax", q, k)
    from beamrl.kernels.qk_norm import fused_qk_norm_ssmax

    return fused_qk_norm_ssmax(q, k, q_weight, k_weight, scale, eps)


# ----------------------------------------------------------------------------------------------------------------
# (c) output gate


def output_gate(o: torch.Tensor, g: torch.Tensor, bias: torch.Tensor, backend: Backend = "eager") -> torch.Tensor:
    """`bf16(o * bf16(sigmoid(bf16(g + b_h))))` for o, g [T, H, D] and the per-head bias [H]."""
    _check_backend("output_gate", backend)
    if backend == "eager":
        return numerics.output_gate(o, g, bias)
    _check_triton_device("output_gate", o, g)
    from beamrl.kernels.output_gate import fused_output_gate

    return fused_output_gate(o, g, bias)


# ----------------------------------------------------------------------------------------------------------------
# (d) router


def route(x: torch.Tensor, router_weight_fp32: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
          n_group: int, topk_group: int, forced_ids: Optional[torch.Tensor] = None,
          backend: Backend = "eager") -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 router logits + DeepSeek-V3 grouped sigmoid top-k. Returns (weights FP32 [T, k], ids int64 [T, k]).

    With `forced_ids` (routing replay, R3) the ids are taken as given and the weights are recomputed from the
    live FP32 sigmoid scores, so gradients reach the router weight and x. Ids are in no particular order
    (SGLang's `sorted=False`); compare routes as sets."""
    _check_backend("route", backend)
    if router_weight_fp32.dtype != torch.float32:
        raise KernelBackendError(f"route: the router weight must be FP32 (beam-numerics §5 #6), "
                                 f"got {router_weight_fp32.dtype}")
    logits = numerics.router_logits(x, router_weight_fp32)
    if forced_ids is not None:
        if forced_ids.shape != (x.shape[0], top_k):
            raise KernelBackendError(f"route: forced_ids must have shape {(x.shape[0], top_k)}, "
                                     f"got {tuple(forced_ids.shape)}")
        forced_ids = forced_ids.to(torch.int64)
    if backend == "eager":
        if forced_ids is not None:
            return numerics.routing_weights(torch.sigmoid(logits), forced_ids), forced_ids
        return numerics.grouped_topk(logits, correction_bias, top_k, n_group, topk_group)
    _check_triton_device("route", x)
    from beamrl.kernels.router_topk import fused_grouped_topk

    # The logits GEMM stays a torch FP32 matmul (cuBLAS SGEMM; see docs/kernels.md for why).
    return fused_grouped_topk(logits, correction_bias, top_k, n_group, topk_group, forced_ids)


# ----------------------------------------------------------------------------------------------------------------
# attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, window: Optional[int],
              backend: AttentionBackend = "eager", block_mask=None) -> torch.Tensor:
    """Packed (THD) causal GQA attention, scale head_dim^-0.5, with an optional sliding window.

    q [T, Hq, D], k/v [T, Hkv, D]; cu_seqlens int [B+1] with cu_seqlens[0] = 0 and cu_seqlens[-1] = T. Key j is
    visible to query i iff both are in the same sequence and i - (window-1) <= j <= i (window=None: full
    causal). Returns [T, Hq, D] in q's dtype.

    block_mask: optional prebuilt `flex_attention.packed_block_mask(cu_seqlens, T, window, device)` for the
    flex backend (the trainer builds it once per micro-batch; it also keeps host syncs out of compiled code)."""
    _check_backend("attention", backend, _ATTENTION_BACKENDS)
    if block_mask is not None:
        if backend == "eager":
            raise KernelBackendError("attention: block_mask is only used by the flex/triton backend")
        from beamrl.kernels.flex_attention import packed_flex_attention

        return packed_flex_attention(q, k, v, cu_seqlens, window, block_mask=block_mask)
    if backend == "eager":
        from beamrl.kernels.packed_attention import packed_attention

        bounds = cu_seqlens.tolist()  # the one host read of the eager path
        _check_bounds(bounds, q.shape[0], tuple(cu_seqlens.shape))
        return packed_attention(q, k, v, bounds, window)
    _check_cu_seqlens(cu_seqlens, q.shape[0])
    from beamrl.kernels.flex_attention import packed_flex_attention

    return packed_flex_attention(q, k, v, cu_seqlens, window)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise KernelBackendError(f"attention: cu_seqlens must be 1-D with at least 2 entries, "
                                 f"got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise KernelBackendError(f"attention: cu_seqlens must start at 0 and end at T={total}, "
                                 f"got {cu_seqlens[0].item()}..{cu_seqlens[-1].item()}")


def _check_bounds(bounds, total: int, shape: tuple) -> None:
    """`_check_cu_seqlens` on the host copy (`cu_seqlens.tolist()`)."""
    if len(shape) != 1 or len(bounds) < 2:
        raise KernelBackendError(f"attention: cu_seqlens must be 1-D with at least 2 entries, got shape {shape}")
    if bounds[0] != 0 or bounds[-1] != total:
        raise KernelBackendError(f"attention: cu_seqlens must start at 0 and end at T={total}, "
                                 f"got {bounds[0]}..{bounds[-1]}")


# ----------------------------------------------------------------------------------------------------------------
# MoE experts


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, scaling: float, backend: Backend = "eager") -> torch.Tensor:
    """Beam's routed-expert computation and combine (beam-numerics §3.10.7-8).

    x [T, H]; ids int [T, k]; weights FP32 [T, k]; w_gate_up [E, 2I, H] (gate rows first); w_down [E, H, I].
    Per (token, slot): `y = bf16(w * acc_fp32(down(bf16(silu(g) * u))))`; out = `bf16(scaling * sum_k y)`.
    eager sorts the pairs by expert and loops experts with `numerics.expert_output`; "triton" runs two
    `torch._grouped_mm` GEMMs (CUDA) with the Triton SwiGLU and combine kernels between/after them; the GEMM's
    BF16 output rounds the down-GEMM accumulator once before the routing weight is applied (documented
    deviation, docs/kernels.md)."""
    _check_backend("grouped_experts", backend)
    if backend == "eager":
        from beamrl.kernels.grouped_experts import eager_grouped_experts

        return eager_grouped_experts(x, ids, weights, w_gate_up, w_down, scaling)
    _check_triton_device("grouped_experts", x)
    from beamrl.kernels.grouped_experts import grouped_mm_experts

    return grouped_mm_experts(x, ids, weights, w_gate_up, w_down, scaling)
