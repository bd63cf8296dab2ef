"""Kernel tests: run Triton kernels on the CPU interpreter when no GPU is present.

TRITON_INTERPRET is Triton's own switch and is read when a kernel module is imported (`@triton.jit`), so it
is set here, before any test imports `beamrl.kernels.<kernel>`; on a CUDA machine the real kernels run.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

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


@pytest.fixture
def checks():
    return Checks


@pytest.fixture
def kernel_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

