"""A weight bucket's copy and its raw-bit checksum in one pass over the bytes: pack (tensors -> bucket) on the
sender, copy out (bucket -> parameters) on the receiver.

Without it each side reads the bucket twice (its copy, and `beamrl.kernels.checksum_rows` for the checksum): four
passes over every byte of a colocated sync, which made the sync device-bound (docs/benchmarks.md, "Weight sync").
Here each program takes a block of whole 4 KiB rows of the bucket, finds the tensors that overlap it (a binary
search over the bucket's word offsets: the layout is contiguous, SGLang's `FlattenedTensorBucket`), and:
- `gather` (pack): loads each tensor's words of the block from the tensor, stores the block into the bucket
  (words past the last tensor as zeros, so the bytes stored are the bytes checksummed);
- scatter (copy out): loads the block from the bucket, stores each tensor's words into the tensor;
then sums the block's rows exactly in int64 (`beamrl.protocols.checksum`: `S`, `W`) from the registers it holds,
with two integer atomics per program, as `checksum_rows` does. Integer sums are exact and order-free, so `out`
equals `bucket_checksum` of the bucket's rows bit for bit.

Tensors are addressed as word offsets from the bucket's own pointer (`(tensor address - bucket address) / 4`), so
no integer is cast to a pointer; when every offset is a multiple of 16 bytes the kernel says so (`ALIGNED`) and
the copies use 16-byte accesses. A bucket whose tensors are not all 4-byte aligned, contiguous, and laid out
back to back is refused (`plan_copy` returns None) and the caller copies and checksums separately.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from beamrl.kernels.checksum_rows import WORDS, add_row_checksums, flush_row_checksums

_ROW_BYTES = 4 * WORDS
#: Launch choices (swept by benchmarks/sync_passes_h200.py): rows per block, the most programs launched
#: (programs loop over blocks beyond that), warps per program.
TUNING: dict = {"rows": 8, "programs": 8192, "warps": 4}
#: Device tables kept (one per bucket layout and set of tensor addresses; a receiver's parameters and a sender's
#: stable exports hit it every sync).
_CACHE_SIZE = 4096
_tables: OrderedDict = OrderedDict()


@triton.jit
def _bucket_copy_kernel(buf_ptr, table_ptr, n_tensors, out_ptr, rows, P: tl.constexpr, PERIOD: tl.constexpr,
                        WORDS: tl.constexpr, ROWS: tl.constexpr, GATHER: tl.constexpr, ALIGNED: tl.constexpr):
    # table: int64 [3, n_tensors]: each tensor's first word in the bucket, its end, and its address as a word
    # offset from buf_ptr minus its first word (so word w of the bucket is at buf_ptr + delta + w).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    blocks = tl.cdiv(rows, ROWS)
    r_in = tl.arange(0, ROWS)
    w_in = tl.arange(0, WORDS)
    s_acc = tl.zeros([ROWS], dtype=tl.int64)
    w_acc = tl.zeros([ROWS], dtype=tl.int64)
    for b in range(pid, blocks, nprog):
        b64 = tl.cast(b, tl.int64)
        r = b64 * ROWS + r_in
        rmask = r < rows
        word = r[:, None] * WORDS + w_in[None, :]
        first = b64 * (ROWS * WORDS)
        last = first + ROWS * WORDS
        # the last tensor that starts at or before the block's first word (starts are sorted, the first is 0)
        lo = 0
        hi = n_tensors
        while hi - lo > 1:
            mid = (lo + hi) // 2
            before = tl.load(table_ptr + mid) <= first
            lo = tl.where(before, mid, lo)
            hi = tl.where(before, hi, mid)
        t = lo
        start = tl.load(table_ptr + t)
        if GATHER:
            v = tl.zeros([ROWS, WORDS], dtype=tl.int32)
        else:
            v = tl.load(buf_ptr + word, mask=rmask[:, None], other=0)
        while (t < n_tensors) & (start < last):
            end = tl.load(table_ptr + n_tensors + t)
            delta = tl.load(table_ptr + 2 * n_tensors + t)
            if ALIGNED:  # 16-byte aligned spans and addresses: the masks and pointers come in whole 4-word vectors
                start = tl.multiple_of(start, 4)
                end = tl.multiple_of(end, 4)
                delta = tl.multiple_of(delta, 4)
            m = (word >= start) & (word < end)
            if GATHER:
                v = tl.where(m, tl.load(buf_ptr + (delta + word), mask=m, other=0), v)
            else:
                tl.store(buf_ptr + (delta + word), v, mask=m)
            t += 1
            start = tl.load(table_ptr + t, mask=t < n_tensors, other=0)
        if GATHER:
            tl.store(buf_ptr + word, v, mask=rmask[:, None])
        s_acc, w_acc = add_row_checksums(v, r, rmask, s_acc, w_acc, P, PERIOD)
    flush_row_checksums(out_ptr, s_acc, w_acc)


class CopyPlan:
    """One launch of the kernel for one bucket and one set of tensors (`plan_copy`)."""

    def __init__(self, table: torch.Tensor, n_tensors: int, aligned: bool, host: torch.Tensor | None) -> None:
        self.table, self.n_tensors, self.aligned = table, n_tensors, aligned
        self._host = host  # the pinned source of a non-blocking upload, kept alive with the table


def plan_copy(rows: torch.Tensor, spans: Sequence[tuple[int, int]], tensors: Sequence[torch.Tensor]) -> CopyPlan | None:
    """The kernel's table for copying `tensors` to or from `rows` (the bucket's bytes, whole 4 KiB rows, uint8),
    tensor i at bytes `spans[i]` = (start, end) of the bucket (empty tensors left out). None if the kernel cannot
    take them: spans not back to back from byte 0, a span or an address not a multiple of 4, a tensor that is not
    contiguous, on another device, or of another size than its span."""
    if rows.dtype != torch.uint8 or rows.dim() != 1 or rows.numel() % _ROW_BYTES or not tensors:
        return None
    if len(spans) != len(tensors):
        raise ValueError(f"plan_copy: {len(spans)} spans for {len(tensors)} tensors")
    base = rows.data_ptr()
    if base % 16:
        return None
    deltas, aligned, offset = [], True, 0
    for (start, end), t in zip(spans, tensors):
        if (start != offset or start % 4 or end % 4 or t.device != rows.device or not t.is_contiguous()
                or t.numel() * t.element_size() != end - start):
            return None
        diff = t.data_ptr() - base
        if diff % 4:
            return None
        aligned = aligned and diff % 16 == 0 and start % 16 == 0 and end % 16 == 0
        deltas.append(diff // 4 - start // 4)
        offset = end
    if offset > rows.numel():
        raise ValueError(f"plan_copy: the tensors end at byte {offset}, the rows hold {rows.numel()}")
    key = (rows.device, tuple(spans), tuple(deltas))
    plan = _tables.get(key)
    if plan is not None:
        _tables.move_to_end(key)
        return plan
    host = torch.tensor([[s // 4 for s, _ in spans], [e // 4 for _, e in spans], deltas], dtype=torch.int64)
    if rows.is_cuda:
        host = host.pin_memory()
        table = host.to(rows.device, non_blocking=True)  # stream-ordered before the launch that reads it
    else:
        table, host = host, None
    plan = _tables[key] = CopyPlan(table, len(tensors), aligned, host)
    if len(_tables) > _CACHE_SIZE:
        _tables.popitem(last=False)
    return plan


def copy_with_checksum(rows: torch.Tensor, plan: CopyPlan, out: torch.Tensor, gather: bool, p: int,
                       period: int) -> torch.Tensor:
    """Run `plan` (`plan_copy` of the same `rows`): `gather` packs the tensors into `rows`, else copies `rows` out
    into them; `out` (int64 [2], contiguous, on the device) = [S, W] of `rows` as `beamrl.protocols.checksum`
    defines them with modulus `p` and weight period `period`. Queued on the current stream, no host sync."""
    if out.dtype != torch.int64 or out.numel() != 2 or not out.is_contiguous():
        raise ValueError(f"copy_with_checksum writes a contiguous int64 [2], got {out.dtype} {tuple(out.shape)}")
    n_rows = rows.numel() // _ROW_BYTES
    out.zero_()
    block = int(TUNING["rows"])
    grid = (max(1, min(triton.cdiv(n_rows, block), int(TUNING["programs"]))),)
    _bucket_copy_kernel[grid](rows.view(torch.int32), plan.table, plan.n_tensors, out, n_rows, P=p, PERIOD=period,
                              WORDS=WORDS, ROWS=block, GATHER=gather, ALIGNED=plan.aligned,
                              num_warps=int(TUNING["warps"]))
    return out
