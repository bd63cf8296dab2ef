"""rne_bf16: the kernels' explicit FP32 -> BF16 rounding equals torch's cast on hard cases."""

import torch
import triton
import triton.language as tl

import pytest

from beamrl.kernels import _triton_utils
from beamrl.kernels._triton_utils import ROUND_BITS, ROUND_CVT, kernel_flags


def _make_round_kernel():
    """Decorated inside the test, where the interpreter switch is on (see tests/triton_interpreter.py); the
    helper is read from the module, which the switch re-imports interpreted."""

    @triton.jit
    def _round_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
        tl.store(y_ptr + offs, _triton_utils.rne_bf16(x, ROUND_BF16), mask=offs < N)

    return _round_kernel


ROUNDINGS = [ROUND_BITS] + ([ROUND_CVT] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: {ROUND_BITS: "bit-trick", ROUND_CVT: "hw-cvt"}[r])
def test_rne_bf16_matches_torch_cast(kernel_device, rounding):
    g = torch.Generator().manual_seed(0)
    bf = torch.randn(256, generator=g).to(torch.bfloat16).float()
    ulp = bf.abs() * 2.0 ** -8
    hard = torch.cat([
        bf + ulp / 2,  # exact ties: round to even
        bf - ulp / 2,
        bf + ulp * 0.4999, bf + ulp * 0.5001,
        torch.randn(256, generator=g) * 1e-39,  # FP32 subnormals
        torch.tensor([3.3895e38, 3.4e38, float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0]),
        torch.randn(1024, generator=g) * 1e4,
    ])
    x = hard.to(kernel_device)
    y = torch.empty_like(x)
    _round_kernel = _make_round_kernel()
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256, **kernel_flags(torch.bfloat16, rounding))
    ref = x.to(torch.bfloat16).float()
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    # NaN stays NaN
    nan = torch.full((4,), float("nan"), device=kernel_device)
    _round_kernel[(1,)](nan, y, 4, BLOCK=256, **kernel_flags(torch.bfloat16, rounding))
    assert torch.isnan(y[:4]).all()


def test_hardware_rounding_is_refused_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="GPU"):
        kernel_flags(torch.bfloat16, ROUND_CVT)
    assert kernel_flags(torch.float32)["ROUND_BF16"] == 0
