"""The one packing function of a weight sync: a bucket's tensors -> its flat uint8 buffer, in batched copies.

`pack_bucket` is what training, `beamrl bench sync` and `benchmarks/sync_h200.py` all run (through the
orchestrator): the tensors of bucket `k` (as `BucketPlan.assemble` yields them) are copied byte for byte into the
buffer the transport gives for it, laid out as the bucket's `TensorMeta`s say (SGLang's flattened-bucket layout),
with batched copies from the tensors as they are into typed views of the buffer (`copy_tensors`: one
`torch._foreach_copy_` for the small tensors, a plain copy per large one; the views are made once per buffer and
bucket and cached by the transport; no dtype change, no host round trip). On GPU the copies are queued on the current stream; the transport records the
bucket's event after them.

Where the transport checksums the packed bucket on the device (staging slots), `pack_bucket` also writes that
checksum (`BucketChecksum`), and `unpack_bucket` is the receiver's side: copy out of the bucket and checksum it. On
CUDA each is one pass over the bytes (`beamrl.kernels.bucket_copy`: copy and checksum fused) where the layout allows
(every tensor 4-byte aligned, laid out back to back: all of Beam's); otherwise the batched copies and the checksum
kernel run one after the other. The result is the same bytes and the same checksum either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from beamrl.protocols.checksum import MODULUS, WEIGHT_PERIOD, bucket_checksum, padded_rows
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.manifest import FULL, BucketLayout, SyncManifest


#: Tensors of at least this many bytes are copied one by one, as raw bytes: on the H200 a plain uint8 copy moves
#: ~2.1 TB/s, a bf16 copy or `_foreach_copy_`'s chunked kernel ~1.4 TB/s. Smaller ones go in one batched copy. A
#: launch per tensor costs host time (a 512 MiB bucket of 26 tensors: 0.46 ms of launches one by one vs 0.37 ms for
#: one `_foreach_copy_`), which a sync hides while its device work is the longer part (it is, from 64 MiB buckets
#: up): the 2026-12-01 H200 figures in docs/benchmarks.md ("Weight sync") were measured with 8 MiB.
LARGE_COPY_BYTES = 8 << 20


def _as_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous tensor's bytes as a flat uint8 view (None if it is not contiguous)."""
    return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None


def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for every i (same dtypes and shapes), queued on the current stream without a host
    sync: large tensors one by one (as bytes where both are contiguous), the rest in one `torch._foreach_copy_`.
    Used to pack a bucket and to copy it into an engine's weights."""
    small_dst, small_src = [], []
    with torch.no_grad():
        for d, s in zip(dst, src):
            if d.numel() * d.element_size() >= LARGE_COPY_BYTES:
                db, sb = _as_bytes(d), _as_bytes(s)
                if db is not None and sb is not None and d.dtype == s.dtype and d.shape == s.shape:
                    db.copy_(sb, non_blocking=True)
                else:
                    d.copy_(s, non_blocking=True)
            else:
                small_dst.append(d)
                small_src.append(s)
        if small_dst:
            torch._foreach_copy_(small_dst, small_src, non_blocking=True)


def bucket_views(buffer: torch.Tensor, bucket: BucketLayout) -> list[torch.Tensor]:
    """Views of `buffer` as each non-empty tensor of `bucket` (its dtype and shape at its byte range; the plan
    aligns every offset to its element size). Cache them per buffer: they are the same every sync."""
    if bucket.nbytes > buffer.numel():
        raise ValueError(f"bucket {bucket.index} needs {bucket.nbytes} bytes, the buffer has {buffer.numel()}")
    return [buffer[m.start:m.end].view(m.dtype).view(m.shape) for m in bucket.metas if m.end > m.start]


@dataclass
class BucketChecksum:
    """Where `pack_bucket` also writes the checksum of what it packs: `out` (int64 [2], on the device) =
    `bucket_checksum(rows[:padded_rows(nbytes)])`, `rows` being the packing buffer's whole 4 KiB rows (a staging
    slot). `bucket`: the index of the bucket whose checksum `out` holds (None: none yet)."""

    rows: torch.Tensor
    out: torch.Tensor
    bucket: int | None = None


def _spans(bucket: BucketLayout) -> list[tuple[int, int]]:
    return [(m.start, m.end) for m in bucket.metas if m.end > m.start]


def _fused_copy(rows: torch.Tensor, bucket: BucketLayout, tensors: list[torch.Tensor], out: torch.Tensor,
                gather: bool) -> bool:
    """Copy and checksum in one kernel (`beamrl.kernels.bucket_copy`) on CUDA; False where it does not apply.
    On CPU it runs only on Triton's interpreter (`TRITON_INTERPRET=1`, Triton's own switch: the tests' CPU runs)."""
    if not (rows.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    from beamrl.kernels.bucket_copy import copy_with_checksum, plan_copy

    plan = plan_copy(rows, _spans(bucket), tensors)
    if plan is None:
        return False
    copy_with_checksum(rows, plan, out, gather, MODULUS, WEIGHT_PERIOD)
    return True


def pack_bucket(buffer: torch.Tensor, bucket: BucketLayout, tensors: list[torch.Tensor],
                views: list[torch.Tensor] | None = None, checksum: BucketChecksum | None = None) -> torch.Tensor:
    """Copy `tensors` (in `bucket.metas` order) into `buffer[:bucket.nbytes]`; returns that slice. `views` are
    `bucket_views(buffer, bucket)`, passed in when the caller caches them (they are the same every sync).
    `checksum`: also write the packed rows' checksum there (`BucketChecksum`; `buffer` is the start of its rows)."""
    if len(tensors) != len(bucket.metas):
        raise ValueError(f"bucket {bucket.index} has {len(bucket.metas)} tensors, got {len(tensors)}")
    dst = views if views is not None else bucket_views(buffer, bucket)
    src = tensors if len(dst) == len(tensors) else [t for t, m in zip(tensors, bucket.metas) if m.end > m.start]
    if len(src) != len(dst):
        raise ValueError(f"bucket {bucket.index}: {len(src)} non-empty tensors for {len(dst)} views")
    if checksum is None:
        copy_tensors(dst, src)
        return buffer[:bucket.nbytes]
    rows = checksum.rows[:padded_rows(bucket.nbytes)]
    if rows.data_ptr() != buffer.data_ptr():
        raise ValueError(f"bucket {bucket.index}: the checksum's rows do not start at the packing buffer")
    checksum.bucket = None
    if not _fused_copy(rows, bucket, src, checksum.out, gather=True):
        copy_tensors(dst, src)
        bucket_checksum(rows, out=checksum.out)
    checksum.bucket = bucket.index
    return buffer[:bucket.nbytes]


def unpack_bucket(rows: torch.Tensor, bucket: BucketLayout, dst: list[torch.Tensor], views: list[torch.Tensor],
                  out: torch.Tensor) -> None:
    """The receiver's side of a checksummed bucket: `dst[i].copy_(views[i])` (the bucket's non-empty tensors, as
    `bucket_views`) and `out` = `bucket_checksum(rows)`, `rows` being the bucket's bytes in whole 4 KiB rows.
    Queued on the current stream; the caller compares `out` with the sender's checksum."""
    if not _fused_copy(rows, bucket, dst, out, gather=False):
        bucket_checksum(rows, out=out)
        copy_tensors(dst, views)


def pack_session(named: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int | None = None,
                 mode: str = FULL) -> tuple[SyncManifest, list[FlatBucket]]:
    """A whole session at once, for callers that drive a receiver directly (tests, one-off updates): the manifest
    and every bucket packed into its own buffer, with its index and checksum. Same plan and packing as a sync."""
    from beamrl.protocols.checksum import bucket_checksum, checksum_values
    from beamrl.sync.export import specs_of
    from beamrl.sync.plan import DEFAULT_BUCKET_BYTES, plan_buckets

    plan = plan_buckets([specs_of(named)], bucket_bytes or DEFAULT_BUCKET_BYTES)
    buckets = []
    for k, tensors in plan.assemble([list(named)]):
        layout = plan.buckets[k]
        device = tensors[0].device if tensors else torch.device("cpu")
        buffer = pack_bucket(torch.empty(layout.nbytes, dtype=torch.uint8, device=device), layout, tensors)
        buckets.append(FlatBucket(buffer, list(layout.metas), index=k,
                                  checksum=checksum_values(bucket_checksum(buffer))))
    return plan.manifest(version, mode), buckets
