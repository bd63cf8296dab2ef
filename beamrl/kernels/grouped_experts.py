"""Beam's routed experts (beam-numerics §3.10.7-8): eager per-expert loop and `torch._grouped_mm`.

The grouped path runs gather -> grouped GEMM (gate/up) -> Triton SwiGLU -> grouped GEMM (down) -> Triton
weight + un-permute + combine; every step has autograd (the routing weights get gradients).

Both sort the (token, slot) pairs by expert id (stable), run the experts, un-sort, and combine with
`numerics.moe_combine`, so the combine's FP32 sum over slots runs in slot order in both.

Deviation of the grouped path: `torch._grouped_mm` returns BF16 for BF16 inputs (out_dtype must match,
torch 2.11 and 2.13), so the down GEMM's FP32 accumulator is rounded to BF16 once before the routing weight is
applied: `bf16(w * bf16(acc))` instead of the contract's `bf16(w * acc)` (at most one extra BF16 rounding per
(token, expert) output, measured in tests/kernels). SGLang's fused MoE kernel applies w in the FP32 epilogue.
"""

from __future__ import annotations

import torch

from beamrl.models.beam import numerics


def _check(x, ids, weights, w_gate_up, w_down):
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_experts: need x [T, H], ids/weights [T, k], got x {tuple(x.shape)}, "
                         f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    e, two_i, h = w_gate_up.shape
    if h != x.shape[1] or two_i % 2 or w_down.shape != (e, h, two_i // 2):
        raise ValueError(f"grouped_experts: need w_gate_up [E, 2I, H] and w_down [E, H, I] with H={x.shape[1]}, "
                         f"got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")


def sort_by_expert(ids: torch.Tensor, num_experts: int):
    """Stable order of the flattened (token, slot) pairs by expert, their tokens, per-expert counts, inverse."""
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: a static output shape keeps torch.compile graphs whole
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    tokens = order // ids.shape[1]
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return order, tokens, counts, inverse


def eager_grouped_experts(x, ids, weights, w_gate_up, w_down, scaling):
    """Reference: `numerics.expert_output` per expert (`numerics.grouped_expert_outputs`: grouped GEMMs on CPU),
    then `numerics.moe_combine`.

    The experts' rows come from one gather (one backward node) rather than from indexing per expert, whose
    backward materialised a zero gradient of the full x per expert. The gradients are the same as the
    per-expert loop's: `_GatherRows` adds each token's rows in the order its backward passes did (highest
    expert first)."""
    _check(x, ids, weights, w_gate_up, w_down)
    t, k = ids.shape
    num_experts, _, hidden = w_gate_up.shape
    order, tokens, counts, inverse = sort_by_expert(ids, num_experts)
    sizes = counts.tolist()
    xs = _GatherRows.apply(x, tokens, sizes)
    # index_select, not advanced indexing: the same rows, faster on CPU; `order`/`inverse` are permutations, so its
    # backward (index_add_ into zeros) adds each gradient row to a zero once, as index_put's did.
    y = numerics.grouped_expert_outputs(xs, sizes, w_gate_up, w_down, weights.reshape(-1).index_select(0, order))
    return numerics.moe_combine(y.index_select(0, inverse).view(t, k, hidden), scaling)


class _GatherRows(torch.autograd.Function):
    """x[rows] for expert-sorted (token, slot) pairs (`sizes` pairs per expert). Backward adds each expert's rows
    into a zero gradient, highest expert first: the order in which autograd accumulated the per-expert
    `x[tokens_e]` gradients of the loop this replaces (later nodes run first), so the sums match bit for bit."""

    @staticmethod
    def forward(ctx, x, rows, sizes):
        ctx.save_for_backward(rows)
        ctx.sizes = sizes
        ctx.num_rows = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        # One index_add_ per expert, highest first: a single index_add_ of all pairs accumulates BF16 rows
        # at another precision (measured), and the point is the old sums exactly.
        for r, g in zip(reversed(rows.split(ctx.sizes)), reversed(grad.split(ctx.sizes))):
            out.index_add_(0, r, g)
        return out, None, None


class _ExpandTokens(torch.autograd.Function):
    """x[tokens] (one row per (token, slot) pair in expert order) with a deterministic backward: the gradient of
    each token is the FP32 sum of its k rows, gathered in slot order, instead of index_put's atomic BF16 adds."""

    @staticmethod
    def forward(ctx, x, tokens, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x[tokens]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        t = inverse.numel() // ctx.k
        return grad[inverse].view(t, ctx.k, -1).sum(1, dtype=torch.float32).to(grad.dtype), None, None, None


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm_experts(x, ids, weights, w_gate_up, w_down, scaling, fused_glue: bool = True):
    """Two `torch._grouped_mm` GEMMs over expert-sorted tokens (see the module docstring for the deviation).

    fused_glue: SwiGLU and the weight/un-permute/combine run as the Triton kernels of `swiglu.py` and
    `moe_combine.py` (same roundings as the eager chain); False keeps the eager numerics chain (the benchmark's
    "eager with grouped GEMMs" layer)."""
    _check(x, ids, weights, w_gate_up, w_down)
    if not grouped_mm_available():
        raise RuntimeError(f"grouped_experts(backend='triton') needs torch._grouped_mm, missing in torch "
                           f"{torch.__version__}; use backend='eager'")
    if x.dtype != torch.bfloat16 or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16:
        raise TypeError(f"grouped_experts(backend='triton'): torch._grouped_mm needs BF16 x and expert weights, "
                        f"got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    t, k = ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    inter = two_i // 2
    order, tokens, counts, inverse = sort_by_expert(ids, num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = _ExpandTokens.apply(x, tokens, inverse, k)
    # mat_b as [E, K, N] column-major views of the stored [E, N, K] weights (no copy).
    gate_up = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)
    if fused_glue:
        from beamrl.kernels.moe_combine import fused_combine
        from beamrl.kernels.swiglu import fused_swiglu

        down = torch._grouped_mm(fused_swiglu(gate_up), w_down.transpose(-2, -1), offs=offs)
        return fused_combine(down, inverse, weights, scaling)
    act = numerics.swiglu(gate_up[:, :inter], gate_up[:, inter:])
    down = torch._grouped_mm(act, w_down.transpose(-2, -1), offs=offs)
    y = (down.float() * weights.reshape(-1)[order].float().unsqueeze(-1)).to(x.dtype)
    return numerics.moe_combine(y[inverse].view(t, k, hidden), scaling)
