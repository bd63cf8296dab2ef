"""The raw-bit bucket checksum (`beamrl.protocols.checksum`) of whole 4 KiB rows in one memory-bound pass on the GPU.

torch's path is ~6 launches, and its widening row sum (`view(int32).view(rows, 1024).sum(1, dtype=int64)`) reads at
~750 GB/s on the H200; this kernel reads the rows once at ~4 TB/s (docs/benchmarks.md, "Weight sync") and
accumulates `[S, W]` itself: each program sums its rows exactly in int64, reduces them mod P and adds its share to
`out` with integer atomics. Integer sums are exact and order-free, so the result equals the CPU path's bit for bit.
Two launches per bucket (`out.zero_()` and the kernel) instead of six: the per-bucket host cost matters at 64 MiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = 1024  # int32 words per 4 KiB row
#: Launch choices (as the other kernel modules, swept by benchmarks/sync_passes_h200.py): rows per block, and the
#: most programs launched (enough blocks in flight to read at the memory's rate; beyond, programs loop over blocks,
#: which means fewer atomics on the two result words).
TUNING: dict = {"rows": 8, "programs": 8192, "warps": 4}


@triton.jit
def add_row_checksums(v, r, rmask, s_acc, w_acc, P: tl.constexpr, PERIOD: tl.constexpr):
    """The checksum's share of a block of rows (`beamrl.protocols.checksum`): `v` int32 [ROWS, WORDS] holds rows `r`
    (`rmask`: the real ones); returns `s_acc + r_j`, `w_acc + r_j * (j mod PERIOD + 1)` per row, r_j = (exact int64
    row sum) mod P in [0, P). Shared by every kernel that checksums rows it holds."""
    red = tl.sum(v.to(tl.int64), axis=1) % P
    red = tl.where(red < 0, red + P, red)  # C remainder keeps the dividend's sign; the checksum's is in [0, P)
    weight = r.to(tl.int64) % PERIOD + 1
    return s_acc + tl.where(rmask, red, 0), w_acc + tl.where(rmask, red * weight, 0)


@triton.jit
def flush_row_checksums(out_ptr, s_acc, w_acc):
    """Add a program's accumulated [S, W] to `out` (two integer atomics: exact and order-free)."""
    tl.atomic_add(out_ptr, tl.sum(s_acc, axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(w_acc, axis=0))


@triton.jit
def _checksum_kernel(x_ptr, out_ptr, rows, P: tl.constexpr, PERIOD: tl.constexpr, WORDS: tl.constexpr,
                     ROWS: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    w = tl.arange(0, WORDS)
    s_acc = tl.zeros([ROWS], dtype=tl.int64)
    w_acc = tl.zeros([ROWS], dtype=tl.int64)
    for start in range(pid * ROWS, rows, step):
        r = start + tl.arange(0, ROWS)
        m = r < rows
        v = tl.load(x_ptr + r.to(tl.int64)[:, None] * WORDS + w[None, :], mask=m[:, None], other=0)
        s_acc, w_acc = add_row_checksums(v, r, m, s_acc, w_acc, P, PERIOD)
    flush_row_checksums(out_ptr, s_acc, w_acc)


def whole_rows_checksum(buffer: torch.Tensor, out: torch.Tensor, p: int, period: int) -> torch.Tensor:
    """`out` (int64 [2], contiguous) = [S, W] of `buffer`, a uint8 buffer of whole 4 KiB rows (4-byte aligned),
    as `beamrl.protocols.checksum` defines them with modulus `p` and weight period `period`."""
    if buffer.dtype != torch.uint8 or buffer.numel() % (4 * WORDS):
        raise ValueError(f"whole_rows_checksum needs a uint8 buffer of whole 4 KiB rows, got {buffer.dtype} of "
                         f"{buffer.numel()} bytes")
    if out.dtype != torch.int64 or out.numel() != 2 or not out.is_contiguous():
        raise ValueError(f"whole_rows_checksum writes a contiguous int64 [2], got {out.dtype} {tuple(out.shape)}")
    rows = buffer.numel() // (4 * WORDS)
    out.zero_()
    block = int(TUNING["rows"])
    grid = (max(1, min(triton.cdiv(rows, block), int(TUNING["programs"]))),)
    _checksum_kernel[grid](buffer.view(torch.int32), out, rows, P=p, PERIOD=period, WORDS=WORDS, ROWS=block,
                           num_warps=int(TUNING["warps"]))
    return out
