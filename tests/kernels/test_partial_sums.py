"""partial_sums.sum_partials: column sums of one or two row segments, cast, in one launch (interpreter or CUDA)."""

import pytest
import torch

from beamrl.kernels import partial_sums
from beamrl.kernels.partial_sums import sum_partials


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rows,n,total", [((37,), 300, 37), ((5, 19), 70, 30), ((0, 3), 16, 3)])
def test_segment_sums_match_float64(kernel_device, backend, rows, n, total, monkeypatch):
    # several row tiles, a partial last row tile and column block, an empty segment, rows beyond the segments
    monkeypatch.setitem(partial_sums.TUNING, "cols", 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(total + 2, n, generator=g)
    out = sum_partials(x.to(kernel_device), rows, torch.float32, backend).cpu()
    assert out.shape == (len(rows), n)
    start = 0
    for i, r in enumerate(rows):
        ref = x[start:start + r].double().sum(0)
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-6, atol=1e-5)
        start += r


def test_the_bf16_cast_rounds_to_nearest(kernel_device):
    # four rows of 1 + 3*2^-9 sum to 4 + 3*2^-7, 0.75 of a BF16 ulp above 4: nearest is 4 + 2^-5, truncation 4
    x = torch.full((4, 8), 1.0 + 3 * 2.0 ** -9)
    out = sum_partials(x.to(kernel_device), (4,), torch.bfloat16).cpu()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], torch.full((8,), 4.0 + 2.0 ** -5, dtype=torch.bfloat16))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="FP32"):
        sum_partials(torch.zeros(2, 3, dtype=torch.float64), (2,), torch.float32)
    with pytest.raises(ValueError, match="segment"):
        sum_partials(torch.zeros(2, 3), (2, 1), torch.float32)
    with pytest.raises(ValueError, match="backend"):
        sum_partials(torch.zeros(2, 3), (2,), torch.float32, backend="numpy")


def test_weight_gradients_cast_each_segment_to_its_own_dtype_once(kernel_device):
    # a bf16 weight and an FP32 weight: FP32 sums, each cast once (not via the other's dtype)
    from beamrl.kernels.partial_sums import weight_gradients

    x = torch.full((7, 8), 1.0 + 3 * 2.0 ** -9)
    fp32_sum = x[:4].sum(0)
    a, b = weight_gradients(x.to(kernel_device), (4, 3), (torch.bfloat16, torch.float32))
    assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.equal(a.cpu(), fp32_sum.to(torch.bfloat16))
    torch.testing.assert_close(b.cpu(), x[4:].sum(0), rtol=1e-6, atol=0)
    (same,) = weight_gradients(x.to(kernel_device), (7,), (torch.bfloat16,))
    assert same.dtype == torch.bfloat16
