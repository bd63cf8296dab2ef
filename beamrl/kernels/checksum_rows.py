"""Row sums of a weight bucket's raw-bit checksum (`beamrl.protocols.checksum`) in one memory-bound pass on the GPU.

torch's `x.view(int32).view(rows, 1024).sum(1, dtype=int64)` widens while it reduces and reads well below the
memory bandwidth on the H200 (docs/benchmarks.md, "Weight sync"); this kernel loads each 4 KiB row as int32,
widens in registers and sums exactly in int64. The result is the same integers (integer sums are exact and
order-free), so the CPU path and this one give equal checksums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORDS = 1024  # int32 words per 4 KiB row
_ROWS_PER_PROGRAM = 8


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, rows, WORDS: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    w = tl.arange(0, WORDS)
    m = r < rows
    v = tl.load(x_ptr + r.to(tl.int64)[:, None] * WORDS + w[None, :], mask=m[:, None], other=0)
    tl.store(out_ptr + r, tl.sum(v.to(tl.int64), axis=1), mask=m)


def row_sums_triton(buffer: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the exact sum of each 4 KiB row's int32 words of a CUDA uint8 buffer of whole rows."""
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.numel() % (4 * _WORDS):
        raise ValueError(f"row_sums_triton needs a CUDA uint8 buffer of whole 4 KiB rows, got {buffer.device} "
                         f"{buffer.dtype} of {buffer.numel()} bytes")
    words = buffer.view(torch.int32)
    rows = words.numel() // _WORDS
    out = torch.empty(rows, dtype=torch.int64, device=buffer.device)
    _row_sums_kernel[(triton.cdiv(rows, _ROWS_PER_PROGRAM),)](words, out, rows, WORDS=_WORDS, ROWS=_ROWS_PER_PROGRAM)
    return out
