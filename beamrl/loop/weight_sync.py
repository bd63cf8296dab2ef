"""Trainer-side weight push: every trainer rank streams the HF export (a collective); rank 0 ships buckets to
the engines through a registered transport, with engines reached as Ray actors (`ActorReceiver`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from beamrl.loop.ray_utils import ActorCallError, ray_get
from beamrl.sync.bucketing import bucketize
from beamrl.sync.forwarding_receiver import ForwardingReceiver
from beamrl.protocols.weights import WeightReceiver, WeightSyncError

# Ray adds its own latency on top of an engine call's timeout; the engine enforces the call's own limit.
_RPC_SLACK_S = 10.0


class ActorReceiver(ForwardingReceiver):
    """A `WeightReceiver` whose engine lives in an `EngineActor` (same or another node)."""

    def __init__(self, handle, name: str, tp_size: int = 1):
        self._handle, self._name, self._tp = handle, name, tp_size

    @property
    def name(self) -> str:
        return self._name

    @property
    def tp_size(self) -> int:
        return self._tp

    def _forward(self, method: str, timeout: float, *args):
        try:
            return ray_get(self._handle.call.remote(method, *args, timeout=timeout), timeout + _RPC_SLACK_S,
                           f"{self._name}.{method}")
        except ActorCallError as e:
            raise WeightSyncError(str(e)) from None


class WeightPusher:
    """Holds the transport of one trainer rank 0 across syncs (the distributed group is set up once)."""

    def __init__(self, transport_name: str, receivers: list[WeightReceiver], transport_kwargs: dict):
        from beamrl.sync.transports import TRANSPORTS

        self.transport = TRANSPORTS.get(transport_name)(receivers, **transport_kwargs)
        self.connected = False

    def push(self, exporter, version: int, bucket_bytes: int, timeout: float, progress: bool) -> dict:
        t0 = time.perf_counter()
        if not self.connected:
            self.transport.connect(timeout)
            self.connected = True
        nbytes = n = 0
        try:
            self.transport.begin(version, timeout)
            for bucket in bucketize(([(k, v) for k, v in b.tensors.items()] for b in exporter), bucket_bytes):
                self.transport.send_bucket(bucket, timeout)
                nbytes += bucket.nbytes
                n += 1
                if progress:
                    print(f"[sync] v{version}: bucket {n} ({nbytes / 2**20:.1f} MiB so far)", flush=True)
            self.transport.finalize(timeout)
        except BaseException as e:
            self.transport.abort(f"{type(e).__name__}: {e}")
            raise
        seconds = time.perf_counter() - t0
        return {"version": version, "bytes": nbytes, "buckets": n, "seconds": seconds,
                "gbps": nbytes / max(seconds, 1e-9) / 1e9}


_PUSHERS: dict[int, WeightPusher] = {}


def _transport_kwargs(transport: str, trainer) -> dict:
    """Where rank 0 packs buckets and, for the update group, the address engines on other nodes dial."""
    import ray

    device = trainer.device
    if transport == "distributed":
        return {"device": device, "master_address": ray.util.get_node_ip_address()}
    if transport == "colocated":
        return {"device": device}
    if transport == "disk":  # engines must see this node's filesystem (same node, or a shared mount)
        import tempfile
        from pathlib import Path

        return {"directory": Path(tempfile.gettempdir()) / f"beamrl-sync-{os.getpid()}", "config": trainer.config.model}
    raise ValueError(f"sync.transport={transport!r} is not a transport the RL loop knows")


def push_weights(trainer, rank: int, receivers, engine_names, engine_tp, version: int, transport: str,
                 bucket_bytes: int, timeout: float, progress: bool) -> dict | None:
    """Run inside a trainer rank. Rank 0 returns the sync report; other ranks return None."""
    exporter = trainer.export_hf(bucket_bytes)
    if rank != 0:
        for _ in exporter:  # the export is collective: every rank must drain it
            pass
        return None
    pusher = _PUSHERS.get(id(trainer))
    if pusher is None:
        proxies = [ActorReceiver(h, n, tp) for h, n, tp in zip(receivers, engine_names, engine_tp)]
        pusher = _PUSHERS[id(trainer)] = WeightPusher(transport, proxies, _transport_kwargs(transport, trainer))
    return pusher.push(exporter, version, bucket_bytes, timeout, progress)


def save_hf_export(trainer, rank: int, out_dir: str, bucket_bytes: int) -> str | None:
    """Write the trainer's current weights as an HF Beam checkpoint (SGLang's format) from rank 0."""
    from beamrl.models.beam.checkpoint import save_checkpoint

    tensors = {}
    for bucket in trainer.export_hf(bucket_bytes):
        if rank == 0:
            tensors.update(bucket.tensors)
    if rank != 0:
        return None
    save_checkpoint(trainer.config.model, tensors, Path(out_dir))
    return out_dir
