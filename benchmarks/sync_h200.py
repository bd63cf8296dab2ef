#!/usr/bin/env python
"""Weight-sync throughput on H200s through the code path training uses, against the raw hardware path in the same run.

Every sync runs the training orchestrator (`beamrl.sync.orchestrator.WeightSync`: plan, `pack_bucket`, manifest,
per-bucket checksums, commit) and a registered transport into the native engine hosted in its own process (as in
training, where it lives in a Ray actor; here the proxy is a pipe, the rest is the same code):
  --mode colocated    one GPU. Staged buckets: two staging slots shared with the engine once (CUDA-IPC), one CUDA
                      event and a small message per bucket, sender checksum in the slot trailer, receiver checksum
                      compared on the device and settled at commit. Reference: a device-to-device copy of the same
                      bytes on that GPU.
  --mode distributed  two GPUs. The trainer (GPU0, update-group rank 0) NCCL-broadcasts one uint8 buffer per bucket
                      to the engine (GPU1, rank 1). References: a raw NCCL broadcast of the same bytes over the same
                      group, and a GPU0 -> GPU1 peer copy. NCCL_NVLS_ENABLE=0 (NVLink SHARP multicast off).

Both sweep bucket sizes (default 64 MiB, 512 MiB, 2 GiB) over a Beam-shaped state dict (default: the `small`
preset, ~8.4 GB in bf16, router FP32), time begin..commit of a full sync (packing, transfer, the engine's copies
into its parameters, its checksum checks), and check every received tensor bit for bit against the sender (exact
integer checksums of the raw bits; the engine's weights are zeroed before each sync so stale weights cannot pass).
Rows print as they finish, a table at the end; `--json` writes {"rows": [...], "references": {...}, ...}.

  python benchmarks/sync_h200.py --mode colocated --json $OUT/sync_colocated.json        # one H200
  python benchmarks/sync_h200.py --mode distributed --json $OUT/sync_distributed.json    # nvidia-h200-x2
  python benchmarks/sync_h200.py --mode colocated --device cpu                            # CPU smoke run

Needs only torch (+ numpy, pydantic) and the repo on PYTHONPATH (no sglang, no ray, no megatron).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL init, here and in the spawned receiver

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from beamrl.models.beam import preset  # noqa: E402
from beamrl.models.beam.model import BeamForCausalLM  # noqa: E402
from beamrl.models.beam.weights import expected_tensors  # noqa: E402
from beamrl.rollout.native.engine import NativeEngine  # noqa: E402
from beamrl.sync.calls import run_concurrently  # noqa: E402
from beamrl.sync.export import StateDictSource  # noqa: E402
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync  # noqa: E402
from beamrl.sync.process_receiver import HostedEngine  # noqa: E402
from beamrl.sync.transports import TRANSPORTS  # noqa: E402
from beamrl.sync.update_group import broadcast_from_rank0  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_checksum(t: torch.Tensor) -> tuple[int, int]:
    """Exact, order-sensitive checksum of the raw bits: (sum, position-weighted sum) in int64."""
    flat = t.detach().contiguous().view(-1).view(_INT_OF_SIZE[t.element_size()])
    total = weighted = 0
    step = 1 << 26  # chunks keep the int64 temporaries small (the embedding has ~0.8 G elements)
    for start in range(0, flat.numel(), step):
        bits = flat[start:start + step].to(torch.int64)
        pos = torch.arange(start, start + bits.numel(), device=bits.device, dtype=torch.int64) % 1009 + 1
        total += int(bits.sum())
        weighted += int((bits * pos).sum())
    return total, weighted


class BenchReceiver(NativeEngine):
    """The native engine plus what the benchmark asks of the receiver side."""

    def checksums(self) -> dict[str, tuple[int, int]]:
        return {n: bit_checksum(p) for n, p in self.model.named_parameters()}

    def zero_weights(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self._sync()

    def raw_broadcast_recv(self, group_name: str, nbytes: int, iters: int) -> None:
        """Join `iters` raw uint8 broadcasts of `nbytes` on the update group (the NCCL reference)."""
        pg = self._receiver._groups[group_name]
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.model.device)
        for _ in range(iters):
            torch.distributed.broadcast(buf, src=0, group=pg)
        self._sync()

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)


def make_receiver(preset_name: str, dtype: str, device: str) -> BenchReceiver:
    """Runs in the receiver process: an uninitialised model (every weight arrives by sync)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = BeamForCausalLM(preset(preset_name), dtype=_DTYPES[dtype], device=device, seed=None)
    return BenchReceiver.from_model(model, name=f"native@{device}")


def sender_tensors(preset_name: str, dtype: torch.dtype, device: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Beam-shaped random tensors in HF names, generated directly on the device (router/bias FP32)."""
    torch.manual_seed(seed)
    return [(name, torch.randn(spec.shape, dtype=spec.dtype(dtype), device=device))
            for name, spec in expected_tensors(preset(preset_name)).items()]


def sync_device() -> None:
    """Wait for every visible GPU (a peer copy involves two)."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def timed(fn, iters: int) -> float:
    """Seconds per call of `fn` (after one warm-up call)."""
    fn()
    sync_device()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync_device()
    return (time.perf_counter() - t0) / iters


def copy_gbps(nbytes: int, src_device: str, dst_device: str, iters: int) -> float:
    """GB/s (1e9 bytes/s of payload) of a plain copy_ of `nbytes` from src to dst device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    return nbytes / timed(lambda: dst.copy_(src, non_blocking=True), iters) / 1e9


def raw_broadcast_gbps(transport, engine: HostedEngine, nbytes: int, iters: int, timeout: float) -> float:
    """GB/s of raw uint8 broadcasts of `nbytes` over the transport's update group (trainer rank 0 -> receiver)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=transport.device)
    group, pg = transport.group_name, transport._pg

    def both(n: int) -> None:
        def trainer_side() -> None:
            for _ in range(n):
                broadcast_from_rank0(pg, buf)

        run_concurrently("raw broadcast", [
            (engine.name, lambda: engine.call("raw_broadcast_recv", group, nbytes, n, timeout=timeout)),
            ("trainer", trainer_side)], timeout)

    both(1)  # warm-up: the first NCCL op on a communicator sets up its channels
    t0 = time.perf_counter()
    both(iters)
    return nbytes * iters / (time.perf_counter() - t0) / 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", required=True, choices=["colocated", "distributed"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: H200(s); cpu: tiny smoke run (shared memory / gloo)")
    p.add_argument("--preset", default=None, help="state-dict shapes (default: small on cuda, tiny on cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--bucket-mb", default=None,
                   help="comma-separated bucket sizes in MiB (default 64,512,2048 on cuda; 0.0625,0.5,2 on cpu)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per bucket size (after one warm-up)")
    p.add_argument("--staging-slots", type=int, default=2, help="colocated: staging buffers (2 = double buffering)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per engine call / bucket")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats must be >= 1, got {args.repeats}")
        return 2
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is visible (use --device cpu for the smoke run)")
        return 2
    if cuda and args.mode == "distributed" and torch.cuda.device_count() < 2:
        print(f"error: --mode distributed needs 2 GPUs, {torch.cuda.device_count()} visible")
        return 2
    preset_name = args.preset or ("small" if cuda else "tiny")
    sizes_mb = [float(x) for x in (args.bucket_mb or ("64,512,2048" if cuda else "0.0625,0.5,2")).split(",")]
    trainer_dev = "cuda:0" if cuda else "cpu"
    engine_dev = ("cuda:1" if args.mode == "distributed" else "cuda:0") if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(0)

    tensors = sender_tensors(preset_name, _DTYPES[args.dtype], trainer_dev, seed=0)
    source = StateDictSource(tensors)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    want = {n: bit_checksum(t) for n, t in tensors}
    print(f"sync_h200: mode={args.mode} device={args.device} preset={preset_name} dtype={args.dtype} "
          f"tensors={len(tensors)} total={total / 1e9:.3f} GB trainer={trainer_dev} engine={engine_dev} "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
          + (f" gpu={torch.cuda.get_device_name(0)} torch={torch.__version__}" if cuda else ""), flush=True)

    t0 = time.perf_counter()
    engine = HostedEngine(make_receiver, (preset_name, args.dtype, engine_dev), name=f"native@{engine_dev}",
                          start_timeout=args.timeout)
    print(f"receiver process up in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.mode == "colocated":
        transport = TRANSPORTS.get("colocated")([engine], device=trainer_dev, staging_slots=args.staging_slots)
    else:
        transport = TRANSPORTS.get("distributed")([engine], device=trainer_dev)
    timeouts = SyncTimeouts.uniform(args.timeout)
    rows: list[dict] = []
    refs: dict[str, float] = {}
    try:
        transport.connect(args.timeout)
        ref_bytes = min(total, 2 * 2**30)
        if args.mode == "colocated":
            refs["d2d_copy_gbps"] = copy_gbps(ref_bytes, trainer_dev, engine_dev, iters=5)
        else:
            refs["raw_broadcast_gbps"] = raw_broadcast_gbps(transport, engine, ref_bytes, 5, args.timeout)
            refs["peer_copy_gbps"] = copy_gbps(ref_bytes, trainer_dev, engine_dev, iters=5)
        print(f"references ({ref_bytes / 2**20:.0f} MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in refs.items()),
              flush=True)

        for mb in sizes_mb:
            sync = WeightSync(transport, [engine], bucket_bytes=int(mb * 2**20), timeouts=timeouts,
                              initial_version=engine.served_weight_version(args.timeout), progress=None)
            seconds, report = [], None
            for rep in range(args.repeats + 1):  # rep 0 warms up (slot attach, NCCL comm set-up, views)
                engine.call("zero_weights", timeout=args.timeout)
                report = sync.sync(source)
                got = engine.call("checksums", timeout=args.timeout)
                bad = [n for n in want if got.get(n) != want[n]]
                if bad:
                    raise SystemExit(f"CHECKSUM MISMATCH after sync (bucket {mb:g} MiB): {len(bad)} tensors, "
                                     f"e.g. {bad[:3]}")
                if rep > 0:
                    seconds.append(report.seconds)
            best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
            row = {"mode": args.mode, "device": args.device, "preset": preset_name, "bucket_mib": mb,
                   "buckets": report.buckets, "bytes": report.bytes, "seconds_best": best, "seconds_median": median,
                   "gbps_best": report.bytes / best / 1e9, "gbps_median": report.bytes / median / 1e9,
                   "checksums_equal_every_sync": True, "transport_mode": getattr(transport, "mode", args.mode),
                   "code_path": report.code_path}
            rows.append(row)
            print(f"  bucket {mb:8.2f} MiB  {report.buckets:5d} buckets  {report.bytes / 1e9:7.3f} GB  "
                  f"best {best:8.4f} s {row['gbps_best']:8.1f} GB/s  median {median:8.4f} s "
                  f"{row['gbps_median']:8.1f} GB/s  checksums equal after {args.repeats + 1} syncs", flush=True)
    finally:
        transport.close()
        engine.shutdown()

    print()
    ref_name, ref = next(iter(refs.items()))
    print(f"| mode | bucket MiB | buckets | GB | best s | sync GB/s (best) | median GB/s | {ref_name} | "
          f"sync / reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} ({r['transport_mode']}) | {r['bucket_mib']:g} | {r['buckets']} | {r['bytes'] / 1e9:.3f} | "
              f"{r['seconds_best']:.4f} | {r['gbps_best']:.1f} | {r['gbps_median']:.1f} | {ref:.1f} | "
              f"{100 * r['gbps_best'] / ref:.1f} % |")
    if rows:
        print(f"code path: {rows[0]['code_path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "references": refs, "preset": preset_name, "dtype": args.dtype,
                       "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if cuda else None}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
