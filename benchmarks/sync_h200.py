#!/usr/bin/env python
"""Weight-sync throughput on H200s through the code path training uses, against the raw hardware path in the same run.

Every sync runs the training orchestrator (`beamrl.sync.orchestrator.WeightSync`: plan, `pack_bucket`, manifest,
per-bucket checksums, commit) and a registered transport into the native engine hosted in its own process (as in
training, where it lives in a Ray actor; here the proxy is a pipe, the rest is the same code):
  --mode colocated    one GPU. Staged buckets: staging slots (2-4 by bucket size) shared with the engine once (CUDA-IPC), one CUDA
                      event and a small message per bucket, sender checksum in the slot trailer, receiver checksum
                      compared on the device and settled at commit. Reference: a device-to-device copy of the same
                      bytes on that GPU.
  --mode per_rank     one GPU. Colocated buckets from every trainer rank (what the RL loop uses for engines of TP > 1
                      or layouts over several nodes), with one trainer rank: its persistent rank slots (CUDA IPC,
                      shared once), a `RankedFlatBucket` of handles per bucket, the engine opening its entry, each
                      slot held until the engine replied. Reference: the same device-to-device copy.
  --mode distributed  two GPUs. The trainer (GPU0, update-group rank 0) NCCL-broadcasts one uint8 buffer per bucket
                      to the engine (GPU1, rank 1). References: per bucket size, raw NCCL broadcasts of the same
                      bytes in the same bucket sizes over the same group, measured right after that size's syncs
                      (the row's "sync / it", issue 12's >= 80 % target); plus a 2 GiB raw broadcast and a GPU0 ->
                      GPU1 peer copy. NCCL_NVLS_ENABLE=0 (NVLink SHARP multicast off).
  --mode teardown     two GPUs, as distributed: `--cycles` (default 20) of open (a fresh update group), one sync
                      (checksums compared), close (timed: issue 12's "each close under 2 s, no timeout").

Both sweep bucket sizes (default 64 MiB, 512 MiB, 2 GiB) over a Beam-shaped state dict (default: the `small`
preset, ~8.4 GB in bf16, router FP32), time begin..commit of a full sync (packing, transfer, the engine's copies
into its parameters, its checksum checks), and check every received tensor bit for bit against the sender (exact
integer checksums of the raw bits; the engine's weights are zeroed before each sync so stale weights cannot pass).
Rows print as they finish, a table at the end; `--json` writes {"rows": [...], "references": {...}, ...}.

  python benchmarks/sync_h200.py --mode colocated --json $OUT/sync_colocated.json        # one H200
  python benchmarks/sync_h200.py --mode distributed --json $OUT/sync_distributed.json    # nvidia-h200-x2
  python benchmarks/sync_h200.py --mode teardown --json $OUT/sync_teardown.json          # nvidia-h200-x2
  python benchmarks/sync_h200.py --mode per_rank --json $OUT/sync_per_rank.json          # one H200
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
from beamrl.sync.rank_payload import Colocation  # noqa: E402
from beamrl.sync.rank_slots import RankSlots  # noqa: E402
from beamrl.sync.transports import TRANSPORTS  # noqa: E402
from beamrl.sync.transports.colocated import ColocatedTransport  # noqa: E402
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

    _host_n, _host_s = 0, 0.0  # staged buckets handled, and the host seconds spent in them

    def load_staged_bucket(self, slot: int, index: int, timeout: float) -> None:
        t0 = time.perf_counter()
        try:
            super().load_staged_bucket(slot, index, timeout)
        finally:
            self._host_n, self._host_s = self._host_n + 1, self._host_s + time.perf_counter() - t0

    def host_stats(self) -> tuple[int, float]:
        """(staged buckets, host seconds in them) since the last call."""
        stats, (self._host_n, self._host_s) = (self._host_n, self._host_s), (0, 0.0)
        return stats

    def checksums(self) -> dict[str, tuple[int, int]]:
        return {n: bit_checksum(p) for n, p in self.model.named_parameters()}

    def zero_weights(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self._sync()

    def raw_broadcast_recv(self, group_name: str, sizes: list[int], iters: int) -> None:
        """Join `iters` rounds of raw uint8 broadcasts of `sizes` bytes each on the update group (the reference)."""
        pg = self._receiver._groups[group_name]
        buf = torch.empty(max(sizes), dtype=torch.uint8, device=self.model.device)
        for _ in range(iters):
            for n in sizes:
                torch.distributed.broadcast(buf[:n], src=0, group=pg)
        self._sync()

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)


class TimedColocated(ColocatedTransport):
    """The colocated transport with host-time counters around its steps: where a sync's time goes (begin; per
    bucket: waiting for a slot, the rest of `buffer`, `send` = checksum into the trailer + event + message;
    finalize = the last buckets' replies + the commit)."""

    _STEPS = ("begin", "wait", "buffer", "send", "finalize")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_buffer = False
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"buckets": 0, **{f"{k}_s": 0.0 for k in self._STEPS}}

    def _timed(self, step: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats[f"{step}_s"] += time.perf_counter() - t0

    def begin(self, manifest, timeout: float) -> None:
        self._timed("begin", super().begin, manifest, timeout)

    def _wait_slot(self, slot, timeout: float) -> None:
        if self._in_buffer:
            self._timed("wait", super()._wait_slot, slot, timeout)
        else:
            super()._wait_slot(slot, timeout)

    def buffer(self, bucket, timeout: float):
        self._in_buffer = True
        try:
            return self._timed("buffer", super().buffer, bucket, timeout)
        finally:
            self._in_buffer = False

    def send(self, bucket, timeout: float) -> None:
        self.stats["buckets"] += 1
        self._timed("send", super().send, bucket, timeout)

    def finalize(self, timeout: float) -> None:
        self._timed("finalize", super().finalize, timeout)


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


def raw_broadcast_gbps(transport, engine: HostedEngine, sizes: list[int], iters: int, timeout: float,
                       warmup: bool = True) -> float:
    """GB/s of raw uint8 broadcasts over the transport's update group (trainer rank 0 -> receiver): `iters` rounds
    of one broadcast per entry of `sizes` (bytes), each waited for as the transport waits for a bucket."""
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=transport.device)
    group, pg = transport.group_name, transport._pg

    def both(n: int) -> None:
        def trainer_side() -> None:
            for _ in range(n):
                for size in sizes:
                    broadcast_from_rank0(pg, buf[:size])

        run_concurrently("raw broadcast", [
            (engine.name, lambda: engine.call("raw_broadcast_recv", group, sizes, n, timeout=timeout)),
            ("trainer", trainer_side)], timeout)

    if warmup:
        both(1)  # the first NCCL op on a communicator sets up its channels
    t0 = time.perf_counter()
    both(iters)
    return sum(sizes) * iters / (time.perf_counter() - t0) / 1e9


def teardown(args, engine: HostedEngine, source: StateDictSource, want: dict, trainer_dev: str, bucket_bytes: int,
             preset_name: str) -> int:
    """`--cycles` of open (a fresh update group), sync, close, through the orchestrator with a transport factory
    (as training builds it); each close timed. Any close error or timeout ends the run with rc 1."""
    timeouts = SyncTimeouts.uniform(args.timeout)
    factory = lambda recs: TRANSPORTS.get("distributed")(recs, device=trainer_dev,  # noqa: E731
                                                         teardown_timeout=args.teardown_timeout)
    rows: list[dict] = []
    error = None
    try:
        for cycle in range(args.cycles):
            engine.call("zero_weights", timeout=args.timeout)
            sync = WeightSync(factory, [engine], bucket_bytes=bucket_bytes, timeouts=timeouts,
                              initial_version=engine.served_weight_version(args.timeout), progress=None)
            t0 = time.perf_counter()
            try:
                report = sync.sync(source)
            finally:
                t1 = time.perf_counter()
                sync.close()
                t2 = time.perf_counter()
            got = engine.call("checksums", timeout=args.timeout)
            equal = all(got.get(n) == c for n, c in want.items())
            rows.append({"cycle": cycle, "open_and_sync_s": t1 - t0, "close_s": t2 - t1, "buckets": report.buckets,
                         "checksums_equal": equal})
            print(f"  cycle {cycle + 1:2d}/{args.cycles}: open+sync {t1 - t0:7.3f} s ({report.buckets} buckets), "
                  f"close {t2 - t1:6.3f} s, checksums {'equal' if equal else 'DIFFER'}", flush=True)
            if not equal:
                raise SystemExit(f"CHECKSUM MISMATCH after cycle {cycle}")
    except Exception as exc:  # a close that timed out raises here: report it with the cycles so far
        error = f"{type(exc).__name__}: {exc}"
        print(f"teardown cycle {len(rows) + 1} failed: {error}", flush=True)
    finally:
        engine.shutdown()
    closes = [r["close_s"] for r in rows]
    if closes:
        print(f"close: max {max(closes):.3f} s, median {sorted(closes)[len(closes) // 2]:.3f} s over {len(closes)} "
              f"cycles (target: each < 2 s, no timeout)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "teardown", "device": args.device, "preset": preset_name, "bucket_bytes": bucket_bytes,
                       "cycles": rows, "max_close_s": max(closes) if closes else None, "error": error,
                       "teardown_timeout_s": args.teardown_timeout, "torch": torch.__version__}, f, indent=2)
    return 1 if error is not None else 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", required=True, choices=["colocated", "per_rank", "distributed", "teardown"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: H200(s); cpu: tiny smoke run (shared memory / gloo)")
    p.add_argument("--preset", default=None, help="state-dict shapes (default: small on cuda, tiny on cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--bucket-mb", default=None,
                   help="comma-separated bucket sizes in MiB (default 64,512,2048 on cuda; 0.0625,0.5,2 on cpu)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per bucket size (after one warm-up)")
    p.add_argument("--staging-slots", type=int, default=None,
                   help="colocated: staging buffers (default: as training, 2-4 by bucket size: auto_staging_slots)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per engine call / bucket")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--cycles", type=int, default=20, help="teardown: open-sync-close cycles")
    p.add_argument("--teardown-timeout", type=float, default=10.0,
                   help="teardown: the transport's teardown_timeout (s), as training uses it")
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
    if cuda and args.mode in ("distributed", "teardown") and torch.cuda.device_count() < 2:
        print(f"error: --mode distributed needs 2 GPUs, {torch.cuda.device_count()} visible")
        return 2
    preset_name = args.preset or ("small" if cuda else "tiny")
    if args.mode == "teardown":
        default_mb = "512" if cuda else "0.0625"
    else:
        default_mb = "64,512,2048" if cuda else "0.0625,0.5,2"
    sizes_mb = [float(x) for x in (args.bucket_mb or default_mb).split(",")]
    trainer_dev = "cuda:0" if cuda else "cpu"
    engine_dev = ("cuda:0" if args.mode in ("colocated", "per_rank") else "cuda:1") if cuda else "cpu"
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
    if args.mode == "teardown":
        return teardown(args, engine, source, want, trainer_dev, int(sizes_mb[0] * 2**20), preset_name)
    rank_slots = None
    if args.mode == "colocated":
        transport = TimedColocated([engine], device=trainer_dev, staging_slots=args.staging_slots)
        staged_stats = True
    elif args.mode == "per_rank":
        rank_slots = RankSlots(0, trainer_dev, num_slots=args.staging_slots or 2)
        transport = TRANSPORTS.get("colocated")([engine], device=trainer_dev, rank_slots=rank_slots,
                                                colocations={engine.name: Colocation((0,))})
        staged_stats = False
    else:
        transport = TRANSPORTS.get("distributed")([engine], device=trainer_dev)
        staged_stats = False
    timeouts = SyncTimeouts.uniform(args.timeout)
    rows: list[dict] = []
    refs: dict[str, float] = {}
    try:
        transport.connect(args.timeout)
        ref_bytes = min(total, 2 * 2**30)
        if args.mode in ("colocated", "per_rank"):
            refs["d2d_copy_gbps"] = copy_gbps(ref_bytes, trainer_dev, engine_dev, iters=5)
        else:
            refs["raw_broadcast_gbps"] = raw_broadcast_gbps(transport, engine, [ref_bytes], 5, args.timeout)
            refs["peer_copy_gbps"] = copy_gbps(ref_bytes, trainer_dev, engine_dev, iters=5)
        print(f"references ({ref_bytes / 2**20:.0f} MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in refs.items()),
              flush=True)

        for mb in sizes_mb:
            sync = WeightSync(transport, [engine], bucket_bytes=int(mb * 2**20), timeouts=timeouts,
                              initial_version=engine.served_weight_version(args.timeout), progress=None,
                              rank_slots=rank_slots)
            seconds, report = [], None
            host: dict = {}  # the host-time breakdown of the fastest timed sync
            for rep in range(args.repeats + 1):  # rep 0 warms up (slot attach, NCCL comm set-up, views)
                engine.call("zero_weights", timeout=args.timeout)
                if staged_stats:
                    transport.reset_stats()
                    engine.call("host_stats", timeout=args.timeout)
                report = sync.sync(source)
                if staged_stats and rep > 0:
                    n, sec = engine.call("host_stats", timeout=args.timeout)
                    if not host or report.seconds < host["sync_s"]:
                        host = {**transport.stats, "receiver_buckets": n, "receiver_s": sec,
                                "sync_s": report.seconds}
                got = engine.call("checksums", timeout=args.timeout)
                bad = [n for n in want if got.get(n) != want[n]]
                if bad:
                    raise SystemExit(f"CHECKSUM MISMATCH after sync (bucket {mb:g} MiB): {len(bad)} tensors, "
                                     f"e.g. {bad[:3]}")
                if rep > 0:
                    seconds.append(report.seconds)
            best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
            extra = {}
            if staged_stats and host.get("buckets"):
                per = 1e3 / host["buckets"]  # ms per bucket, in the fastest timed sync
                loop = host["sync_s"] - host["begin_s"] - host["finalize_s"]
                extra = {"host_ms_per_bucket": {
                    "all_in": host["sync_s"] * per, "bucket_loop": loop * per,
                    "sender_wait_for_slot": host["wait_s"] * per,
                    "sender_buffer_other": (host["buffer_s"] - host["wait_s"]) * per,
                    "sender_send": host["send_s"] * per,
                    "sender_pack_and_assemble": (loop - host["buffer_s"] - host["send_s"]) * per,
                    "receiver_load_staged_bucket": host["receiver_s"] * 1e3 / max(host["receiver_buckets"], 1)},
                    "begin_ms": host["begin_s"] * 1e3, "finalize_ms": host["finalize_s"] * 1e3}
                print(f"    fastest sync: begin {extra['begin_ms']:.2f} ms, finalize {extra['finalize_ms']:.2f} ms", flush=True)
                print("    host ms per bucket: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                          extra["host_ms_per_bucket"].items()), flush=True)
            if args.mode == "distributed":  # the same bytes, in the same bucket sizes, as raw broadcasts
                sizes = [b.nbytes for b in sync.plan(source).buckets]
                raw = max(raw_broadcast_gbps(transport, engine, sizes, 1, args.timeout, warmup=False)
                          for _ in range(args.repeats))  # best round, as the sync's best
                extra = {"raw_broadcast_bytes": sum(sizes), "raw_broadcast_broadcasts": len(sizes),
                         "raw_broadcast_same_bytes_gbps": raw,
                         "sync_fraction_of_raw_broadcast": report.bytes / best / 1e9 / raw}
            row = {"mode": args.mode, "device": args.device, "preset": preset_name, "bucket_mib": mb,
                   "buckets": report.buckets, "bytes": report.bytes, "seconds_best": best, "seconds_median": median,
                   "gbps_best": report.bytes / best / 1e9, "gbps_median": report.bytes / median / 1e9,
                   "checksums_equal_every_sync": True, "transport_mode": getattr(transport, "mode", args.mode),
                   "code_path": report.code_path, **extra}
            rows.append(row)
            print(f"  bucket {mb:8.2f} MiB  {report.buckets:5d} buckets  {report.bytes / 1e9:7.3f} GB  "
                  f"best {best:8.4f} s {row['gbps_best']:8.1f} GB/s  median {median:8.4f} s "
                  f"{row['gbps_median']:8.1f} GB/s  checksums equal after {args.repeats + 1} syncs"
                  + (f"  raw broadcast of the same bytes {extra['raw_broadcast_same_bytes_gbps']:.1f} GB/s: sync = "
                     f"{100 * extra['sync_fraction_of_raw_broadcast']:.1f} % of it" if "raw_broadcast_same_bytes_gbps" in extra else ""), flush=True)
    finally:
        transport.close()
        engine.shutdown()

    print()
    ref_name, ref = next(iter(refs.items()))
    same = args.mode == "distributed"
    print(f"| mode | bucket MiB | buckets | GB | best s | sync GB/s (best) | median GB/s | {ref_name} | "
          f"sync / reference |" + (" raw broadcast, same bytes GB/s | sync / it |" if same else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if same else ""))
    for r in rows:
        print(f"| {r['mode']} ({r['transport_mode']}) | {r['bucket_mib']:g} | {r['buckets']} | {r['bytes'] / 1e9:.3f} | "
              f"{r['seconds_best']:.4f} | {r['gbps_best']:.1f} | {r['gbps_median']:.1f} | {ref:.1f} | "
              f"{100 * r['gbps_best'] / ref:.1f} % |"
              + (f" {r['raw_broadcast_same_bytes_gbps']:.1f} | {100 * r['sync_fraction_of_raw_broadcast']:.1f} % |"
                 if same else ""))
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
