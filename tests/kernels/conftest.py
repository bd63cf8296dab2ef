"""Kernel tests: Triton kernels run on the CPU interpreter when no GPU is present (on a CUDA machine the real
kernels run). The interpreter is switched on for each test of this folder only (`triton_interpreter`, see
tests/triton_interpreter.py), never for the whole session.
"""

import pytest
import torch

BF16_EPS = 2.0 ** -8


class Checks:
    """Comparison helpers shared by the kernel tests."""

    @staticmethod
    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double(), b.double()
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    @staticmethod
    def bit_mismatch(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
        """(number of differing elements, max difference in units of b's BF16 ulp)."""
        assert a.shape == b.shape and a.dtype == b.dtype
        diff = a != b
        if not diff.any():
            return 0, 0.0
        ulp = torch.where(b.float() == 0, torch.tensor(2.0 ** -133), b.float().abs() * BF16_EPS)
        return int(diff.sum()), float(((a.float() - b.float()).abs() / ulp)[diff].max())


    @staticmethod
    def assert_near_bit_equal(a: torch.Tensor, b: torch.Tensor, max_frac: float) -> None:
        """Bit-equal except for a fraction <= max_frac of elements, each off by at most one BF16 ulp of a value at
        the tensor's scale (2^-7 of max |b|). This is the normalising kernels' contract: their FP32 sum of
        squares runs in another order than torch's reduction, which flips a BF16 rounding of the normed value
        in a few elements per million; a later cancellation (RoPE, the residual add) can make that many ulps of
        a small output."""
        n, _ = Checks.bit_mismatch(a, b)
        scale = float(b.float().abs().max())
        max_abs = float((a.float() - b.float()).abs().max())
        assert n <= max_frac * b.numel(), f"{n} of {b.numel()} elements differ"
        assert max_abs <= scale * 2 * BF16_EPS, f"max |diff| {max_abs} above one BF16 ulp at the scale {scale}"


@pytest.fixture(autouse=True)
def _kernels_on_the_interpreter(triton_interpreter):
    return triton_interpreter


@pytest.fixture
def checks():
    return Checks


@pytest.fixture
def kernel_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

