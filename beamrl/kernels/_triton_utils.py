"""Shared Triton helpers: exact BF16 rounding, an IEEE sigmoid, launch options (triton 3.6 and 3.8).

Why explicit rounding: the kernels must reproduce the eager reference's BF16 rounding points bit for bit.
`rne_bf16` rounds an FP32 value to the nearest BF16 (ties to even) and returns it as FP32, so every
intermediate rounding is explicit and the final `.to(bfloat16)` is exact. On a GPU it is the hardware's
round-to-nearest-even conversion (`cvt.rn.bf16.f32`, one instruction); under TRITON_INTERPRET=1, whose
FP32->BF16 cast truncates instead of rounding, it is the integer bit trick. The bit trick costs ~7 integer
instructions per rounding, which made the many-rounding kernels (sandwich norm: 5 to 9 per element) compute-bound
on the H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # triton >= 3.0 keeps libdevice here on every backend
    from triton.language.extra import libdevice
except ImportError as err:  # pragma: no cover - the pinned tritons (3.6 GPU, 3.8 CI) both have it
    raise ImportError("beamrl.kernels needs triton >= 3.0 (triton.language.extra.libdevice)") from err


def triton_interpret_enabled() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1 is Triton's own switch)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# No FMA contraction: the eager reference runs each multiply and add as a separately rounded FP32 op. The
# products that feed an add also go through `mul_rn`, so this holds when another launcher (torch.compile)
# drops the option. Scalar float arguments are cast to FP32 in every kernel for the same reason (inductor may
# pass Python floats as FP64).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


# Values of the ROUND_BF16 constexpr: no rounding (FP32 activations), the integer bit trick, the hardware cast.
ROUND_NONE, ROUND_BITS, ROUND_CVT = 0, 1, 2


# Launch tuning read at call time. "rounding" overrides kernel_flags' default choice; benchmarks/kernel_sweep.py
# sets it (and each kernel module's own TUNING) to time the alternatives. Results do not depend on any entry
# except the reduction-order ones that each module names.
TUNING: dict = {"rounding": None}


def kernel_flags(dtype: torch.dtype, rounding: int | None = None) -> dict:
    """constexpr flags shared by every kernel: how to round to BF16 where the contract rounds, interpreter mode.

    rounding: None picks the hardware cast on a GPU and the bit trick under the interpreter; ROUND_BITS can be
    forced (benchmarks/kernel_sweep.py times both; tests/kernels checks both are bit-equal to torch)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"beamrl.kernels supports bfloat16 and float32 activations, got {dtype}")
    interpret = triton_interpret_enabled()
    rounding = TUNING["rounding"] if rounding is None else rounding
    if dtype != torch.bfloat16:
        mode = ROUND_NONE
    elif rounding is None:
        mode = ROUND_BITS if interpret else ROUND_CVT
    elif rounding == ROUND_CVT and interpret:
        raise ValueError("ROUND_CVT needs a GPU: the interpreter's FP32->BF16 cast truncates")
    elif rounding in (ROUND_BITS, ROUND_CVT):
        mode = rounding
    else:
        raise ValueError(f"rounding must be ROUND_BITS ({ROUND_BITS}) or ROUND_CVT ({ROUND_CVT}), got {rounding}")
    return {"ROUND_BF16": mode, "INTERPRET": interpret}


def num_programs_for_reduction(device: torch.device, rows: int, per_sm: int = 4) -> int:
    """Programs of a persistent kernel (programs walk rows): `per_sm` per SM, at most one per row. The backward
    kernels keep per-program weight-gradient partials, so fewer programs also mean fewer partials to sum."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, per_sm * sms))
    return max(1, min(rows, 4))


@triton.jit
def rne_bf16(x, ROUND_BF16: tl.constexpr):
    """Round FP32 x to the nearest BF16 value (ties to even), kept in FP32. Identity when ROUND_BF16 is 0
    (ROUND_NONE); the hardware cast for ROUND_CVT, the integer bit trick for ROUND_BITS.

    NaN payloads may change; infinities and finite values round like `tensor.to(torch.bfloat16)`."""
    if ROUND_BF16 == 2:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    elif ROUND_BF16 == 1:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        out = rounded.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, out)
    else:
        return x


@triton.jit
def mul_rn(a, b, INTERPRET: tl.constexpr):
    """`a * b` rounded on its own: never contracted into an FMA with a following add, whatever the launch
    options (torch.compile launches user kernels with its own), as the eager reference computes it."""
    if INTERPRET:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def exp_f32(x, INTERPRET: tl.constexpr):
    """Accurate expf (libdevice, as PyTorch's `std::exp`), not Triton's ex2.approx; numpy under the interpreter."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def sigmoid_f32(x, INTERPRET: tl.constexpr):
    """PyTorch's CUDA sigmoid `1 / (1 + exp(-x))` with an IEEE division."""
    return tl.math.div_rn(1.0, 1.0 + exp_f32(-x, INTERPRET))
