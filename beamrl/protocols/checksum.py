"""The raw-bit checksum of a weight bucket: computed by the sender after packing, checked by the receiver before it
commits the bucket (docs/weight-sync.md, "Verification").

`bucket_checksum(buffer)` is two int64 numbers, computed on the buffer's own device with a few kernels and no host
round trip (the result stays a device tensor until someone reads it). The buffer is read as 32-bit words in rows of
4 KiB; with `r_j` = (sum of row j's words, exact in int64) mod P, P = 2^31 - 1, in [0, P):

- `S = sum_j r_j`: any change confined to one word, in particular any single flipped bit, changes it (it changes
  one `r_j` by a change of +-2^k, k <= 31, mod P, which is never 0);
- `W = sum_j r_j * (j mod 1021 + 1)`: position-weighted, so moving or swapping rows (a tensor packed at the
  wrong offset) changes it too.

Both sums are exact in int64 (no final reduction, so any summation order gives the same integers) for buffers up to
`MAX_BYTES` (~16 GiB). It is cheap (one read of the bytes; on CUDA one Triton kernel, `beamrl.kernels.checksum_rows`,
elsewhere a few torch ops) and not cryptographic: it guards against corruption and
mix-ups in transit, not against an adversary. Buffers of any length are accepted (a trailing partial row counts as
the last row, a trailing partial word as a little-endian integer); callers that own the memory past the bucket
(the staging slots) checksum whole rows.
"""

from __future__ import annotations

import torch

ROW_BYTES = 4096
_ROW_WORDS = ROW_BYTES // 4
_P = 2**31 - 1
_PERIOD = 1021
MODULUS, WEIGHT_PERIOD = _P, _PERIOD  # for kernels that compute the checksum themselves (`beamrl.kernels`)
#: S and W are exact int64 sums (no final reduction): W < rows * P * 1021 must stay below 2^63
MAX_BYTES = (2**63 // (_P * _PERIOD)) * ROW_BYTES
_weights: dict[torch.device, torch.Tensor] = {}


def _row_weights(rows: int, device: torch.device) -> torch.Tensor:
    """int64 [2, rows]: ones, and (j mod 1021) + 1. One table per device, grown to the largest bucket seen and
    sliced, so buckets of any size need no new upload (no host round trip per bucket)."""
    w = _weights.get(device)
    if w is None or w.shape[1] < rows:
        size = max(rows, 2 * (w.shape[1] if w is not None else 0), 1 << 14)
        j = torch.arange(size, dtype=torch.int64)
        w = _weights[device] = torch.stack([torch.ones_like(j), j % _PERIOD + 1]).to(device)
    return w[:, :rows]


def bucket_checksum(buffer: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 tensor [S, W] (module docstring) of a 1-D uint8 `buffer`, on the buffer's device (into `out` if
    given: a contiguous int64 [2] on that device)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"bucket_checksum needs a 1-D uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}")
    if buffer.storage_offset() % 4:
        raise ValueError(f"bucket_checksum needs a 4-byte aligned buffer (storage offset {buffer.storage_offset()})")
    n = buffer.numel()
    if n > MAX_BYTES:
        raise ValueError(f"bucket_checksum: {n} bytes is above {MAX_BYTES} (W would overflow int64); use smaller "
                         f"buckets")
    full = n // ROW_BYTES
    if out is None:
        out = torch.empty(2, dtype=torch.int64, device=buffer.device)
    first = 0  # the first row whose r_j is summed below (the CUDA kernel does the whole rows itself)
    parts = []
    if full and buffer.is_cuda:
        from beamrl.kernels.checksum_rows import whole_rows_checksum

        whole_rows_checksum(buffer[:full * ROW_BYTES], out, _P, _PERIOD)
        first = full
    else:
        out.zero_()
        if full:
            parts.append(buffer[:full * ROW_BYTES].view(torch.int32).view(full, _ROW_WORDS).sum(1, dtype=torch.int64))
    rest = buffer[full * ROW_BYTES:]
    if rest.numel():  # the partial last row (only for buffers that are not whole rows)
        n4 = rest.numel() // 4 * 4
        last = rest[:n4].view(torch.int32).sum(dtype=torch.int64)
        if n4 < rest.numel():
            tail = rest[n4:].to(torch.int64)
            last = last + (tail << (torch.arange(tail.numel(), device=buffer.device, dtype=torch.int64) * 8)).sum()
        parts.append(last.reshape(1))
    if parts:
        r = torch.remainder(parts[0] if len(parts) == 1 else torch.cat(parts), _P)
        out += (r * _row_weights(first + r.numel(), buffer.device)[:, first:]).sum(1)
    return out


def padded_rows(nbytes: int) -> int:
    """`nbytes` rounded up to whole checksum rows."""
    return -(-nbytes // ROW_BYTES) * ROW_BYTES


def checksum_values(checksum: torch.Tensor) -> tuple[int, int]:
    """The two numbers as Python ints (reads the device tensor: a host round trip)."""
    s, w = checksum.tolist()
    return int(s), int(w)
