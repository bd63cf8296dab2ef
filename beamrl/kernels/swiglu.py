"""Fused SwiGLU on the packed gate/up GEMM output: `bf16(silu(fp32 g) * fp32 u)` (beam-numerics §3.9-3.10.7).

Input [N, 2I] (gate columns first, as the packed `gate_up_proj`), output [N, I]: one read and one write instead
of the eager chain's FP32 intermediates. silu is PyTorch's CUDA form `x / (1 + expf(-x))` with an IEEE
division, so the BF16 output equals `numerics.swiglu` bit for bit. The backward pass writes d[gate|up] in one
pass: `dg = da * u * s * (1 + g * (1 - s))`, `du = da * silu(g)`, s = sigmoid(g).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import LAUNCH_OPTIONS, exp_f32, kernel_flags, rne_bf16

# Launch tuning (benchmarks/kernel_sweep.py times the choices on a GPU); none changes a result bit. Programs
# take [rows, block] tiles; a block that divides I (2560 = 5 x 512) leaves no masked lanes.
TUNING: dict = {"block": 512, "rows": 4, "warps": 4, "bwd_block": 512, "bwd_rows": 4, "bwd_warps": 8}


@triton.jit
def _fwd_kernel(gu_ptr, act_ptr, N, I, stride_gu, RB: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr,
                INTERPRET: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (rows < N)[:, None] & (cols < I)[None, :]
    src = (rows * stride_gu)[:, None] + cols[None, :]
    g = tl.load(gu_ptr + src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + src + I, mask=m, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + exp_f32(-g, INTERPRET))
    dst = (rows * I)[:, None] + cols[None, :]
    tl.store(act_ptr + dst, rne_bf16(silu * u, ROUND_BF16).to(act_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd_kernel(gu_ptr, da_ptr, dgu_ptr, N, I, stride_gu, RB: tl.constexpr, BLOCK: tl.constexpr,
                INTERPRET: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (rows < N)[:, None] & (cols < I)[None, :]
    src = (rows * stride_gu)[:, None] + cols[None, :]
    g = tl.load(gu_ptr + src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + src + I, mask=m, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + (rows * I)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + exp_f32(-g, INTERPRET))
    dg = da * u * s * (1.0 + g * (1.0 - s))
    du = da * g * s
    dst = (rows * (2 * I))[:, None] + cols[None, :]
    tl.store(dgu_ptr + dst, dg.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dgu_ptr + dst + I, du.to(dgu_ptr.dtype.element_ty), mask=m)


def _tile(inter: int, block_key: str, rows_key: str) -> tuple[int, int]:
    return min(int(TUNING[block_key]), triton.next_power_of_2(inter)), int(TUNING[rows_key])


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        n, two_i = gate_up.shape
        inter = two_i // 2
        act = torch.empty(n, inter, device=gate_up.device, dtype=gate_up.dtype)
        if n:
            block, rb = _tile(inter, "block", "rows")
            _fwd_kernel[(triton.cdiv(n, rb), triton.cdiv(inter, block))](
                gate_up, act, n, inter, gate_up.stride(0), RB=rb, BLOCK=block, num_warps=int(TUNING["warps"]),
                **kernel_flags(gate_up.dtype), **LAUNCH_OPTIONS)
        ctx.save_for_backward(gate_up)
        return act

    @staticmethod
    def backward(ctx, d_act):
        (gate_up,) = ctx.saved_tensors
        n, two_i = gate_up.shape
        inter = two_i // 2
        d_gu = torch.empty(n, two_i, device=gate_up.device, dtype=gate_up.dtype)
        if n:
            block, rb = _tile(inter, "bwd_block", "bwd_rows")
            _bwd_kernel[(triton.cdiv(n, rb), triton.cdiv(inter, block))](
                gate_up, d_act.contiguous(), d_gu, n, inter, gate_up.stride(0), RB=rb, BLOCK=block,
                num_warps=int(TUNING["bwd_warps"]), INTERPRET=kernel_flags(gate_up.dtype)["INTERPRET"])
        return d_gu


def fused_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`numerics.swiglu(gate_up[:, :I], gate_up[:, I:])` in one Triton pass, with a fused backward."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"swiglu: need a row-major [N, 2I] gate/up tensor, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    return _SwiGLU.apply(gate_up)


def backward_reference(gate_up: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    """The backward kernel's math in plain torch: d[gate|up]."""
    inter = gate_up.shape[1] // 2
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    s = torch.sigmoid(g)
    return torch.cat((d_act * u * s * (1 + g * (1 - s)), d_act * g * s), dim=1)
