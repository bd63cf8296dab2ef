"""The fused bucket copy (interpreter on CPU, the real kernel on CUDA): packing gives the bytes `pack_bucket`'s
torch copies give and the checksum `bucket_checksum` gives; copying out gives back every tensor bit for bit with the
same checksum; across blocks that hold several tensors, tensors that span several blocks, the programs' block loop,
negative row sums, unaligned (4- but not 16-byte) offsets; layouts the kernel cannot take are refused."""

import pytest
import torch

from beamrl.protocols import checksum
from beamrl.protocols.checksum import ROW_BYTES, bucket_checksum, padded_rows
from beamrl.protocols.flat_bucket import layout


def _bucket(device, shapes_dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    names = [f"t{i}" for i in range(len(shapes_dtypes))]
    metas = layout(names, [d for _, d in shapes_dtypes], [s for s, _ in shapes_dtypes])
    tensors = []
    for shape, dtype in shapes_dtypes:
        raw = torch.randint(-2**31, 2**31 - 1, (max(1, torch.Size(shape).numel() * dtype.itemsize // 4),),
                            dtype=torch.int32, generator=g)
        tensors.append(raw.view(torch.uint8)[:torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
                       .to(device))
    nbytes = metas[-1].end
    return metas, tensors, nbytes


def _torch_pack(rows, metas, tensors):
    for m, t in zip(metas, tensors):
        rows[m.start:m.end].copy_(t.reshape(-1).view(torch.uint8))
    return rows


# 4-byte but not 16-byte offsets (a 3-word fp32 tensor), a tensor spanning many blocks, small ones sharing a block
LAYOUTS = {
    "mixed": [((3,), torch.float32), ((70, 130), torch.float32), ((6,), torch.bfloat16), ((1000, 37), torch.bfloat16),
              ((2,), torch.bfloat16)],
    "aligned": [((4096,), torch.float32), ((64, 512), torch.bfloat16), ((8,), torch.bfloat16)],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pack_and_copy_out_equal_the_torch_path(kernel_device, name, monkeypatch):
    from beamrl.kernels import bucket_copy

    monkeypatch.setitem(bucket_copy.TUNING, "rows", 2)
    monkeypatch.setitem(bucket_copy.TUNING, "programs", 3)  # several blocks per program: the loop runs
    metas, tensors, nbytes = _bucket(kernel_device, LAYOUTS[name])
    spans = [(m.start, m.end) for m in metas]
    n = padded_rows(nbytes)
    stale = torch.full((n,), 0xAB, dtype=torch.uint8, device=kernel_device)  # a reused slot's old bytes

    rows = stale.clone()
    plan = bucket_copy.plan_copy(rows, spans, tensors)
    assert plan is not None and plan.aligned == (name == "aligned")
    out = torch.full((2,), -7, dtype=torch.int64, device=kernel_device)
    bucket_copy.copy_with_checksum(rows, plan, out, gather=True, p=checksum._P, period=checksum._PERIOD)
    want = _torch_pack(torch.zeros(n, dtype=torch.uint8), metas, [t.cpu() for t in tensors])
    assert torch.equal(rows.cpu(), want)  # the tail past the last tensor is zeroed, not the slot's old bytes
    assert torch.equal(out.cpu(), bucket_checksum(want))

    # copy out: into zeroed tensors, from rows whose tail holds other bytes (they count in the checksum only)
    rows[nbytes:] = 0x5C
    received = [torch.zeros_like(t) for t in tensors]
    plan_out = bucket_copy.plan_copy(rows, spans, received)
    got = torch.zeros(2, dtype=torch.int64, device=kernel_device)
    bucket_copy.copy_with_checksum(rows, plan_out, got, gather=False, p=checksum._P, period=checksum._PERIOD)
    for r, t in zip(received, tensors):
        assert torch.equal(r.view(torch.uint8), t.view(torch.uint8))
    assert torch.equal(got.cpu(), bucket_checksum(rows.cpu()))
    assert not torch.equal(got.cpu(), out.cpu())  # the tail bytes changed: the checksum saw them


def test_one_flipped_bit_changes_the_copy_out_checksum(kernel_device):
    from beamrl.kernels import bucket_copy

    metas, tensors, nbytes = _bucket(kernel_device, LAYOUTS["aligned"], seed=3)
    spans = [(m.start, m.end) for m in metas]
    rows = torch.zeros(padded_rows(nbytes), dtype=torch.uint8, device=kernel_device)
    sent = torch.zeros(2, dtype=torch.int64, device=kernel_device)
    bucket_copy.copy_with_checksum(rows, bucket_copy.plan_copy(rows, spans, tensors), sent, True, checksum._P,
                                   checksum._PERIOD)
    rows[ROW_BYTES + 5] ^= 4
    received = [torch.zeros_like(t) for t in tensors]
    got = torch.zeros(2, dtype=torch.int64, device=kernel_device)
    bucket_copy.copy_with_checksum(rows, bucket_copy.plan_copy(rows, spans, received), got, False, checksum._P,
                                   checksum._PERIOD)
    assert got[0].item() != sent[0].item()


def test_layouts_the_kernel_cannot_take_are_refused(kernel_device):
    from beamrl.kernels.bucket_copy import plan_copy

    rows = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=kernel_device)
    a = torch.zeros(4, dtype=torch.float32, device=kernel_device)
    odd = torch.zeros(3, dtype=torch.bfloat16, device=kernel_device)  # 6 bytes: not whole words
    assert plan_copy(rows, [(0, 16)], [a]) is not None
    assert plan_copy(rows, [(0, 6)], [odd]) is None
    assert plan_copy(rows, [(16, 32)], [a]) is None  # not back to back from byte 0
    assert plan_copy(rows, [(0, 16)], [torch.zeros(8, 4, device=kernel_device)[:, 0]]) is None  # not contiguous
    assert plan_copy(rows[:ROW_BYTES - 4], [(0, 16)], [a]) is None  # not whole rows
    shifted = torch.zeros(24, dtype=torch.uint8, device=kernel_device)[2:18]  # 16 bytes at an address 2 mod 4
    assert plan_copy(rows, [(0, 16)], [shifted]) is None
