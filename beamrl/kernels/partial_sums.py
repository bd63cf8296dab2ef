"""Sum per-program FP32 weight-gradient partials and cast them, in one launch.

The normalising kernels' backward passes (sandwich norms, q/k norms, output gate) write one FP32 partial row
per program and need the column sums in the weight's dtype. In torch that is 2 to 5 small launches
(sums, slices, casts) of a few microseconds each, against a ~100 us kernel; here it is one launch whose
programs each own a column block of one segment (a run of consecutive partial rows, e.g. the q rows then the
k rows). The sum order is fixed by the launch shape, so results are deterministic run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from beamrl.kernels._triton_utils import kernel_flags, rne_bf16


@triton.jit
def _sum_kernel(src_ptr, out_ptr, N, rows_0, rows_1, ROWS: tl.constexpr, COLS: tl.constexpr,
                STAGES: tl.constexpr, ROUND_BF16: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    cm = cols < N
    start = tl.where(seg == 0, 0, rows_0)
    count = tl.where(seg == 0, rows_0, rows_1)
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    r = tl.arange(0, ROWS)
    for r0 in tl.range(0, count, ROWS, num_stages=STAGES):  # tall segments (q/k: ~10^3 rows): loads in flight
        rows = r0 + r
        m = (rows < count)[:, None] & cm[None, :]
        acc += tl.load(src_ptr + (start + rows).to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
    # one rounding to the output dtype, to nearest (the interpreter's own cast truncates; see rne_bf16)
    total = rne_bf16(tl.sum(acc, axis=0), ROUND_BF16)
    tl.store(out_ptr + seg * N + cols, total.to(out_ptr.dtype.element_ty), mask=cm)


# Launch shape; it changes only the FP32 sum order. Narrow column blocks give a tall, thin segment (q/k norm
# partials: [tiles x head blocks, 128]) several programs: one 128-wide program per segment of 3,072 rows made
# the q/k backward 140 us slower on the H200 than torch's sums (docs/benchmarks.md).
TUNING: dict = {"rows": 32, "cols": 32, "warps": 4, "stages": 3}


def sum_partials(partials: torch.Tensor, rows: tuple[int, ...], dtype: torch.dtype,
                 backend: str = "triton") -> torch.Tensor:
    """Column sums of consecutive row segments of an FP32 [R, N] tensor, cast to `dtype`: returns [len(rows), N].

    rows: the row count of each segment (one or two segments, together at most R). backend "torch" does the same
    with torch ops (the sweep times both)."""
    if partials.dtype != torch.float32 or partials.dim() != 2 or not partials.is_contiguous():
        raise ValueError(f"sum_partials: partials must be a contiguous FP32 [R, N] tensor, got "
                         f"{partials.dtype} {tuple(partials.shape)}")
    if not 1 <= len(rows) <= 2 or sum(rows) > partials.shape[0] or min(rows) < 0:
        raise ValueError(f"sum_partials: rows {rows} must be one or two segment sizes within {partials.shape[0]}")
    if backend == "torch":
        return torch.stack([seg.sum(0) for seg in partials[:sum(rows)].split(list(rows))]).to(dtype)
    if backend != "triton":
        raise ValueError(f"sum_partials: backend must be 'triton' or 'torch', got {backend!r}")
    n = partials.shape[1]
    out = torch.empty(len(rows), n, device=partials.device, dtype=dtype)
    if n == 0:
        return out
    cols = min(int(TUNING["cols"]), triton.next_power_of_2(n))
    _sum_kernel[(len(rows), triton.cdiv(n, cols))](partials, out, n, rows[0], rows[1] if len(rows) > 1 else 0,
                                                   ROWS=int(TUNING["rows"]), COLS=cols, STAGES=int(TUNING["stages"]),
                                                   ROUND_BF16=kernel_flags(dtype)["ROUND_BF16"],
                                                   num_warps=int(TUNING["warps"]))
    return out


def weight_gradients(partials: torch.Tensor, rows: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                     backend: str = "triton") -> list[torch.Tensor]:
    """`sum_partials` with one dtype per segment (each segment is one weight's gradient, e.g. the q and k norm
    weights): one launch in their common dtype, or FP32 sums cast once each when the dtypes differ."""
    common = dtypes[0] if all(d == dtypes[0] for d in dtypes) else torch.float32
    return [s.to(d) for s, d in zip(sum_partials(partials, rows, common, backend), dtypes)]
