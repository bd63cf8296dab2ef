"""The bucket checksum changes with any single flipped bit (anywhere, including a partial last word) and with rows
moved within the buffer; it is the same on equal bytes, and `out=` writes it in place."""

import random

import pytest
import torch

from beamrl.protocols.checksum import ROW_BYTES, bucket_checksum, checksum_values, padded_rows


@pytest.mark.parametrize("nbytes", [2, 6, 4096, 3 * ROW_BYTES + 10, 20 * ROW_BYTES])
def test_every_single_bit_flip_changes_it(nbytes):
    g = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    base = checksum_values(bucket_checksum(buf))
    assert base == checksum_values(bucket_checksum(buf.clone()))
    rng = random.Random(nbytes)
    positions = {0, nbytes - 1} | {rng.randrange(nbytes) for _ in range(200)}
    for pos in sorted(positions):
        for bit in (0, 7) if nbytes > 100 else range(8):
            flipped = buf.clone()
            flipped[pos] ^= 1 << bit
            assert checksum_values(bucket_checksum(flipped)) != base, (pos, bit)


def test_a_byte_moved_within_the_trailing_partial_word_changes_it():
    """The trailing partial word is read little-endian: the same byte at another position in it is another value."""
    n = ROW_BYTES + 3  # one whole row, then a partial word of 3 bytes
    a, b = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    a[-3], b[-2] = 1, 1
    assert checksum_values(bucket_checksum(a)) != checksum_values(bucket_checksum(b))


def test_swapped_rows_change_it_and_out_is_written_in_place():
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (8 * ROW_BYTES,), dtype=torch.uint8, generator=g)
    swapped = buf.clone()
    swapped[:ROW_BYTES], swapped[5 * ROW_BYTES:6 * ROW_BYTES] = buf[5 * ROW_BYTES:6 * ROW_BYTES], buf[:ROW_BYTES]
    a, b = bucket_checksum(buf), bucket_checksum(swapped)
    assert a[0] == b[0] and a[1] != b[1]  # the plain sum cannot see a move; the weighted one does
    out = torch.full((2,), -1, dtype=torch.int64)
    assert bucket_checksum(buf, out=out) is out and torch.equal(out, a)


def test_refuses_what_it_cannot_read_and_pads_to_rows():
    with pytest.raises(ValueError, match="1-D uint8"):
        bucket_checksum(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="aligned"):
        bucket_checksum(torch.zeros(16, dtype=torch.uint8)[1:])
    assert padded_rows(1) == padded_rows(ROW_BYTES) == ROW_BYTES and padded_rows(ROW_BYTES + 1) == 2 * ROW_BYTES
    assert checksum_values(bucket_checksum(torch.zeros(0, dtype=torch.uint8))) == (0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the Triton checksum kernel of the CUDA path")
def test_the_cuda_checksum_equals_the_cpu_checksum():
    g = torch.Generator().manual_seed(1)
    for nbytes in (ROW_BYTES, 37 * ROW_BYTES + 6, (64 << 20) + 12):
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        assert checksum_values(bucket_checksum(buf.cuda())) == checksum_values(bucket_checksum(buf)), nbytes
