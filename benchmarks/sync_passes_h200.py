#!/usr/bin/env python
"""The GPU passes of a colocated weight sync, timed one by one on a Beam-shaped bucket (where a sync's device time
goes): packing (`pack_bucket`, and one `_foreach_copy_` of the same tensors for comparison), the raw-bit checksum
(`bucket_checksum`: the Triton kernel on CUDA; torch's widening row sum alone for comparison), and the engine's copy
out (`copy_tensors`), next to one plain device copy of the same bytes; and the fused passes a sync runs now: the pack
with its checksum (`pack_bucket(..., checksum=)`) and the copy out with its checksum (`unpack_bucket`), one pass each
on CUDA (`beamrl.kernels.bucket_copy`), with a sweep of that kernel's launch choices. Times one full bucket of each
size.

  python benchmarks/sync_passes_h200.py --json $OUT/sync_passes.json      # one H200
  python benchmarks/sync_passes_h200.py --device cpu --bucket-mb 1         # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import expected_tensors
from beamrl.protocols.checksum import ROW_BYTES, bucket_checksum, padded_rows
from beamrl.sync.export import specs_of
from beamrl.sync.packing import BucketChecksum, bucket_views, copy_tensors, pack_bucket, unpack_bucket
from beamrl.sync.plan import plan_buckets


def timed_ms(fn, device: str, iters: int = 10) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default=None)
    p.add_argument("--bucket-mb", default="64,512")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = args.device
    name = args.preset or ("small" if dev == "cuda" else "tiny")
    specs = expected_tensors(preset(name))
    named = [(n, torch.randn(s.shape, dtype=s.dtype(torch.bfloat16), device=dev)) for n, s in specs.items()]
    rows = []
    for mb in [float(x) for x in args.bucket_mb.split(",")]:
        plan = plan_buckets([[s] for s in specs_of(named)], int(mb * 2**20))
        # a full bucket of the plan: the largest within the bucket size (else the largest: one oversized tensor)
        fits = [i for i, b in enumerate(plan.buckets) if b.nbytes <= mb * 2**20] or range(len(plan.buckets))
        k = max(fits, key=lambda i: plan.buckets[i].nbytes)
        layout = plan.buckets[k]
        by_name = dict(named)
        tensors = [by_name[m.name] for m in layout.metas]
        slot = torch.empty(padded_rows(layout.nbytes) + 16, dtype=torch.uint8, device=dev)
        views = bucket_views(slot, layout)
        dst = [torch.empty_like(t) for t in tensors]
        checked = slot[:padded_rows(layout.nbytes)]
        n = layout.nbytes
        r = {"bucket_mib": mb, "bucket_bytes": n, "tensors": len(tensors)}
        r["pack_ms"] = timed_ms(lambda: pack_bucket(slot, layout, tensors, views), dev)
        r["pack_one_foreach_ms"] = timed_ms(lambda: torch._foreach_copy_(views, tensors), dev)
        r["unpack_ms"] = timed_ms(lambda: copy_tensors(dst, views), dev)
        r["checksum_ms"] = timed_ms(lambda: bucket_checksum(checked), dev)
        if dev == "cuda":  # the kernel's launch choices (beamrl.kernels.checksum_rows.TUNING)
            from beamrl.kernels import checksum_rows

            default = dict(checksum_rows.TUNING)
            for rows_, programs, warps in [(8, 1024, 4), (8, 8192, 4), (8, 1 << 20, 4), (16, 8192, 8),
                                           (4, 1 << 20, 4), (16, 1 << 20, 8), (32, 4096, 8)]:
                checksum_rows.TUNING.update(rows=rows_, programs=programs, warps=warps)
                r[f"checksum_r{rows_}_p{programs}_w{warps}_ms"] = timed_ms(lambda: bucket_checksum(checked), dev)
            checksum_rows.TUNING.clear()
            checksum_rows.TUNING.update(default)
        cs = BucketChecksum(slot, torch.zeros(2, dtype=torch.int64, device=dev))
        got = torch.zeros(2, dtype=torch.int64, device=dev)
        r["pack_with_checksum_ms"] = timed_ms(lambda: pack_bucket(slot, layout, tensors, views, cs), dev)
        r["unpack_with_checksum_ms"] = timed_ms(lambda: unpack_bucket(checked, layout, dst, views, got), dev)
        if dev == "cuda":
            from beamrl.kernels import bucket_copy

            plan = bucket_copy.plan_copy(checked, [(m.start, m.end) for m in layout.metas if m.end > m.start], tensors)
            r["fused"] = plan is not None
            r["fused_aligned"] = bool(plan is not None and plan.aligned)
            r["fused_checksums_equal"] = bool(torch.equal(cs.out, got) and torch.equal(got, bucket_checksum(checked)))
            default = dict(bucket_copy.TUNING)
            for rows_, programs, warps in [(4, 8192, 4), (8, 8192, 4), (8, 1 << 20, 4), (16, 8192, 8), (8, 8192, 8),
                                           (4, 1 << 20, 4), (2, 1 << 20, 4)]:
                bucket_copy.TUNING.update(rows=rows_, programs=programs, warps=warps)
                tag = f"r{rows_}_p{programs}_w{warps}"
                r[f"pack_fused_{tag}_ms"] = timed_ms(lambda: pack_bucket(slot, layout, tensors, views, cs), dev)
                r[f"unpack_fused_{tag}_ms"] = timed_ms(lambda: unpack_bucket(checked, layout, dst, views, got), dev)
            bucket_copy.TUNING.clear()
            bucket_copy.TUNING.update(default)
        w32 = checked.view(torch.int32).view(-1, ROW_BYTES // 4)
        r["rowsum_torch_int32_to_int64_ms"] = timed_ms(lambda: w32.sum(1, dtype=torch.int64), dev)
        flat = checked.clone()
        r["plain_copy_ms"] = timed_ms(lambda: flat.copy_(checked), dev)
        for key in [k for k in r if k.endswith("_ms")]:
            r[key.replace("_ms", "_gbps")] = n / (r[key] / 1e3) / 1e9
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None,
                       "torch": torch.__version__}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
