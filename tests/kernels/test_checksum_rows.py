"""The Triton checksum of whole rows (interpreter on CPU, the real kernel on CUDA) equals the torch path of
`bucket_checksum` on the CPU, on random bytes, on rows whose int32 sums are negative, and across the programs'
row-block loop."""

import pytest
import torch

from beamrl.protocols import checksum
from beamrl.protocols.checksum import ROW_BYTES, bucket_checksum


@pytest.mark.parametrize("rows", [1, 9, 37])
def test_kernel_equals_the_torch_checksum(kernel_device, rows, monkeypatch):
    from beamrl.kernels import checksum_rows

    monkeypatch.setitem(checksum_rows.TUNING, "programs", 2)  # several row blocks per program: the loop runs
    g = torch.Generator().manual_seed(rows)
    buf = torch.randint(0, 256, (rows * ROW_BYTES,), dtype=torch.uint8, generator=g)
    buf[:ROW_BYTES] = 255  # a row of -1 words: a negative row sum (C's remainder would go negative)
    want = bucket_checksum(buf)  # the CPU torch path
    out = torch.full((2,), -7, dtype=torch.int64, device=kernel_device)
    got = checksum_rows.whole_rows_checksum(buf.to(kernel_device), out, checksum._P, checksum._PERIOD)
    assert got is out
    assert torch.equal(got.cpu(), want), (got, want)


def test_bad_input_is_refused(kernel_device):
    from beamrl.kernels.checksum_rows import whole_rows_checksum

    out = torch.zeros(2, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="whole 4 KiB rows"):
        whole_rows_checksum(torch.zeros(ROW_BYTES + 4, dtype=torch.uint8, device=kernel_device), out, 7, 5)
    with pytest.raises(ValueError, match="int64"):
        whole_rows_checksum(torch.zeros(ROW_BYTES, dtype=torch.uint8, device=kernel_device), out.int(), 7, 5)
