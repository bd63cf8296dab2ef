"""Rank function of the per-rank colocated sync tests (2 gloo trainer ranks through `beamrl.trainer.megatron.launch`).

Every rank runs the one orchestrator (`WeightSync`) with its own `RankSlots`; rank 0 holds the colocated transport
and an engine of TP 2 that reads its TP rank r's copy of each bucket from the entry of the trainer rank on its
device: the real SGLang CPU engine (in-process adapter, `engine_tp=2`: each scheduler rank deserializes its own
entry), or `NativeTP` (below: TP rank r is a native engine receiver). The export is collective as the Megatron one
is: rank 0 yields the tensors, rank 1 empty units, and `finish` is an all-reduce."""

from __future__ import annotations

import torch

BUCKET = 256 * 1024  # ~11 buckets of the tiny model, so each rank slot is reused within a sync


def _native_tp(names_seen: list):
    from beamrl.models.beam import preset
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.protocols.flat_bucket import FlatBucket
    from beamrl.protocols.weights import ROLLED_BACK, UNHEALTHY, PendingCall, WeightSyncError
    from beamrl.sync.forwarding_receiver import ForwardingReceiver
    from beamrl.sync.local_receiver import LocalWeightReceiver

    class NativeTP(ForwardingReceiver):
        """An engine of TP len(ranks): TP rank r is a real native-engine receiver (`LocalWeightReceiver`) and gets
        entry r of each per-rank payload, as SGLang's scheduler rank r does; every other call goes to every rank
        (the worst abort outcome wins)."""

        def __init__(self, ranks: list[LocalWeightReceiver]) -> None:
            self.ranks = ranks

        @property
        def name(self) -> str:
            return "native-tp2"

        @property
        def tp_size(self) -> int:
            return len(self.ranks)

        def _submit(self, method, timeout, *args):
            try:
                if method == "update_weights_from_tensor":
                    (bucket,) = args
                    names_seen.append([(e.rank, e.path) for e in bucket.entries])
                    for r, rec in enumerate(self.ranks):
                        rec.update_weights_from_tensor(FlatBucket(bucket.rank_buffer(r), bucket.metas, bucket.index,
                                                                  bucket.checksum), timeout)
                    return PendingCall(None)
                out = [getattr(rec, method)(*args, timeout) for rec in self.ranks]
                if method == "abort_weight_update":
                    return PendingCall(UNHEALTHY if UNHEALTHY in out else ROLLED_BACK if ROLLED_BACK in out else out[0])
                return PendingCall(out[0])
            except WeightSyncError as exc:
                return PendingCall(error=exc)

    models = [BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval() for _ in range(2)]
    return NativeTP([LocalWeightReceiver(m, name=f"tp-rank-{r}") for r, m in enumerate(models)]), models


def _source(seed: int):
    import torch.distributed as dist

    from beamrl.models.beam import preset
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.sync.export import StateDictSource

    class CollectiveSource(StateDictSource):
        """Rank 0 holds the tensors; the others get one empty list per unit; `finish` is collective."""

        def stream(self):
            mine = dist.get_rank() == 0
            for unit in self._units:
                yield unit if mine else []

        def finish(self, ok: bool) -> bool:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

    model = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=seed).eval()
    return CollectiveSource(list(model.named_parameters()), unit_size=3), model


def _sglang_tp(workdir: str, names_seen: list):
    """The SGLang CPU engine of TP 2 (float32), started from the tiny model of seed 0; records each payload's
    entries."""
    from beamrl.models.beam import preset
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    import multiprocessing

    # `launch` starts its ranks as daemonic processes, which multiprocessing forbids to have children; SGLang's
    # engine starts its schedulers as children (it shuts them down below, and they exit with their parent).
    multiprocessing.current_process()._config["daemon"] = False
    ckpt = f"{workdir}/start"
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(ckpt)

    class RecordingEngine(SGLangEngine):
        def update_weights_from_tensor(self, bucket, timeout):
            names_seen.append([(e.rank, e.path) for e in bucket.entries])
            super().update_weights_from_tensor(bucket, timeout)

    return RecordingEngine(SGLangEngineConfig.on_cpu(ckpt, dtype="float32", return_routed_experts=False,
                                                     engine_tp=2), start_timeout=900)


def per_rank_sync(engine_kind: str, corrupt_bucket: int | None, workdir: str = "") -> dict:
    """Sync 1: a new model into the TP2 engine (`engine_kind` 'native' or 'sglang'), corrupting trainer rank 1's
    copy of `corrupt_bucket` if given (negative: from the end; the last bucket's failure is seen at the commit); then the slots are released (a sleeping trainer) and sync 2 sends another
    model."""
    import torch.distributed as dist

    from beamrl.protocols.weights import WeightSyncError
    from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
    from beamrl.sync.rank_payload import Colocation
    from beamrl.sync.rank_slots import RankSlots
    from beamrl.sync.transports.colocated import ColocatedTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class FaultySlots(RankSlots):
        corrupt: int | None = None

        def spread(self, bucket):
            super().spread(bucket)
            if self.rank == 1 and bucket.index == self.corrupt:  # rank 1's copy changes after the broadcast
                self.slot(bucket.index).payload(bucket.nbytes)[7] ^= 0x20
            # ... and before the shipping rank sends the bucket (without this barrier the engine could read rank
            # 1's copy before the change: the test then failed about one run in five)
            dist.barrier()

    slots = FaultySlots(rank, "cpu")
    slots.corrupt = corrupt_bucket
    out: dict = {"rank": rank}
    timeouts = SyncTimeouts.uniform(60)
    replicas: list = []
    if rank == 0:
        seen: list = []
        if engine_kind == "native":
            engine, replicas = _native_tp(seen)
        else:
            engine = _sglang_tp(workdir, seen)
        transport = ColocatedTransport([engine], rank_slots=slots, colocations={engine.name: Colocation((0, 1))})
        ws = WeightSync(transport, [engine], bucket_bytes=BUCKET, timeouts=timeouts, rank_slots=slots, progress=None)
    else:
        ws = WeightSync(None, bucket_bytes=BUCKET, timeouts=timeouts, rank_slots=slots, progress=None)

    def snapshot():
        return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in replicas]

    def equal(m, named):
        return all(torch.equal(p, named[n]) for n, p in m.named_parameters())

    try:
        if rank == 0 and engine_kind == "sglang":
            start_checksum = engine.weights_checksum(120)
        for attempt, seed in ((1, 1), (2, 2)):
            source, trainer_model = _source(seed)
            if slots.corrupt is not None and slots.corrupt < 0:  # counted from the end (-1: the last bucket)
                slots.corrupt += len(ws.plan(source).buckets)
            before = snapshot() if rank == 0 else None
            try:
                report = ws.sync(source)
                out[f"sync{attempt}"] = "ok" if report is not None or rank != 0 else "no report"
            except WeightSyncError as exc:
                out[f"sync{attempt}"] = f"refused: {exc}"
            if rank == 0:
                trainer = dict(trainer_model.named_parameters())
                out[f"sync{attempt}_bit_equal"] = [equal(m, trainer) for m in replicas]
                out[f"sync{attempt}_unchanged"] = [equal(m, b) for m, b in zip(replicas, before)]
                out[f"sync{attempt}_version"] = engine.served_weight_version(1)
                if engine_kind == "sglang":  # the weights SGLang computes with, bit for bit (its own checksum)
                    out[f"sync{attempt}_engine_checksum"] = engine.weights_checksum(120)
                    if attempt == 1:
                        out["start_checksum"] = start_checksum
                out[f"sync{attempt}_entries"] = seen[:]
                out[f"sync{attempt}_held"] = transport.keep.outstanding()
                seen.clear()
            slots.corrupt = None
            ws.release_buffers()  # every rank: the trainer goes to sleep between syncs
            out[f"released{attempt}"] = slots.slots == []
        if rank == 0 and engine_kind == "sglang":  # the trainer's last weights through SGLang's own disk loader
            trainer_model.save_pretrained(f"{workdir}/trainer")
            engine.update_weights_from_disk(f"{workdir}/trainer", 300)
            out["disk_checksum"] = engine.weights_checksum(120)
    finally:
        if rank == 0 and engine_kind == "sglang":
            engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return out
