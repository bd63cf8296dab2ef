#!/usr/bin/env python
"""The GPU passes of a colocated weight sync, timed one by one on a Beam-shaped bucket (where a sync's device time
goes): packing (`_foreach_copy_` from the bucket's tensors into the slot), the raw-bit checksum (`bucket_checksum`,
its row-sum kernel alone, and the Triton row-sum kernel), and the engine's copy out, next to one plain device copy
of the same bytes.

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
from beamrl.sync.packing import bucket_views, pack_bucket
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
        # the largest bucket of the plan
        k = max(range(len(plan.buckets)), key=lambda i: plan.buckets[i].nbytes)
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
        r["unpack_ms"] = timed_ms(lambda: torch._foreach_copy_(dst, views), dev)
        r["checksum_ms"] = timed_ms(lambda: bucket_checksum(checked), dev)
        w32 = checked.view(torch.int32).view(-1, ROW_BYTES // 4)
        r["rowsum_int32_to_int64_ms"] = timed_ms(lambda: w32.sum(1, dtype=torch.int64), dev)
        w64 = checked.view(torch.int64).view(-1, ROW_BYTES // 8)
        r["rowsum_int64_ms"] = timed_ms(lambda: w64.sum(1), dev)
        flat = checked.clone()
        r["plain_copy_ms"] = timed_ms(lambda: flat.copy_(checked), dev)
        try:
            from beamrl.kernels.checksum_rows import row_sums_triton
            want = w32.sum(1, dtype=torch.int64)
            got = row_sums_triton(checked)
            r["triton_rowsum_equal"] = bool(torch.equal(want, got))
            r["triton_rowsum_ms"] = timed_ms(lambda: row_sums_triton(checked), dev)
        except Exception as exc:  # no Triton (CPU), or the kernel failed: say so
            r["triton_rowsum"] = f"{type(exc).__name__}: {exc}"
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
