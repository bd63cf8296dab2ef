"""Colocated transport: engines on the trainer's node read each bucket from the trainer's memory.

Three ways, chosen at `connect` from what the transport is given and what the receivers support:
- **staged** (the native engine, in-process or in its own process): `StagingSlot`s shared once (CUDA-IPC on GPU,
  shared memory on CPU); per bucket the trainer packs into slot `k % slots`, writes the bucket's checksum into the
  slot's trailer on the device, records one CUDA event, and sends `(slot, k)`; the engine waits on that event,
  checks the checksum and copies out with one batched copy, then records its own event. No host round trip per
  bucket on either side; the trainer waits for a slot only when it packs into it again.
- **flattened bucket** (SGLang's contract): the same packed bytes go as one `FlatBucket` (index, host checksum)
  through `update_weights_from_tensor`; the SGLang adapter serializes it as SGLang's `flattened_bucket` payload,
  one per engine TP rank (CUDA-IPC handles on GPU).
- **per rank** (given `rank_slots`, every trainer rank's slots: engines of TP > 1, or engines on other nodes than
  the shipping rank): the shipping rank packs into its own rank slot, `WeightSync` spreads the bytes to every
  trainer rank's slot (`beamrl.sync.rank_slots`), and each engine gets a `RankedFlatBucket` whose entry r is the
  slot of the trainer rank on its TP rank r's device (`colocations`, by engine name). Each slot is held
  (`KeepAlive`) until every engine replied for its bucket; `finalize` finds none held; `abort` drops them all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from beamrl.protocols.checksum import bucket_checksum, checksum_values
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.manifest import BucketLayout
from beamrl.protocols.weights import WeightReceiver
from beamrl.sync.calls import run_concurrently
from beamrl.sync.rank_payload import Colocation, KeepAlive, PayloadError, RankedFlatBucket
from beamrl.sync.rank_slots import RankSlots
from beamrl.sync.transports import TRANSPORTS
from beamrl.sync.transports.base import ReceiverTransport


@TRANSPORTS.register("colocated")
class ColocatedTransport(ReceiverTransport):
    """Staged buckets where every receiver supports them, else `flattened_bucket` payloads (module docstring)."""

    name = "colocated"

    def __init__(self, receivers: Sequence[WeightReceiver], device: str | torch.device = "cpu",
                 staging_slots: int | None = None, staged: bool | None = None, rank_slots: RankSlots | None = None,
                 colocations: Mapping[str, Colocation] | None = None) -> None:
        """`staged`: force (True) or forbid (False) staged buckets; None: use them if every receiver can.
        `rank_slots` (the shipping rank's `RankSlots`) and `colocations` (engine name -> `Colocation`): buckets
        from every trainer rank (module docstring); every receiver needs its colocation, of its TP size."""
        if rank_slots is not None:
            if staged:
                raise ValueError("staged buckets come from the shipping rank only; per-rank buckets are flattened")
            missing = [r.name for r in receivers if r.name not in (colocations or {})]
            if missing:
                raise ValueError(f"per-rank colocated buckets need the colocation of every engine; none for "
                                 f"{missing}")
            staging_slots = rank_slots.num_slots
        super().__init__(receivers, device=device, staging_slots=staging_slots)
        self._staged = staged
        self._mode: str | None = None
        self.rank_slots = rank_slots
        self.colocations = dict(colocations or {})
        # per-rank buckets in flight: one per rank slot (other modes hold nothing)
        self.keep = KeepAlive(max_outstanding=rank_slots.num_slots if rank_slots is not None else 1)

    @property
    def mode(self) -> str | None:
        """'staged', 'flattened_bucket' or 'per_rank' once connected."""
        return self._mode

    def connect(self, timeout: float) -> None:
        if self._mode is not None:
            return
        self._require_healthy()
        if self.rank_slots is not None:
            for label, r in zip(self.labels, self.receivers):
                tp = self.colocations[r.name].tp_size
                if r.tp_size != tp:
                    raise PayloadError(f"{label}: an engine of TP {r.tp_size} but its colocation names {tp} "
                                       f"trainer ranks")
            self._mode = "per_rank"
            return
        staged = self._staged
        if staged is None:
            answers: dict[int, bool] = {}

            def ask(i: int, r: WeightReceiver) -> None:
                answers[i] = bool(r.staging_supported(timeout))

            run_concurrently("staging_supported", [(label, (lambda i=i, r=r: ask(i, r)))
                                                   for i, (label, r) in enumerate(zip(self.labels, self.receivers))],
                             timeout, bounded_calls=self._bounded)
            staged = all(answers.values())
        self._mode = "staged" if staged else "flattened_bucket"

    def _use_shared_slots(self, timeout: float) -> bool:
        self.connect(timeout)
        return self._mode == "staged"

    def _ensure_slots(self, manifest, timeout: float) -> None:
        if self._mode != "per_rank":
            super()._ensure_slots(manifest, timeout)
            return
        need = max(b.nbytes for b in manifest.buckets)
        if self.rank_slots.capacity < need or not self.rank_slots.ships:
            raise PayloadError(f"the rank slots hold {self.rank_slots.capacity} bytes, a bucket needs {need}: "
                               f"RankSlots.ensure runs on every trainer rank before begin (WeightSync does)")
        self._slots = self.rank_slots.slots  # the shipping rank packs straight into its own rank slot

    def _drop_slots(self, timeout: float, detach: bool = True) -> None:
        if self._mode == "per_rank":
            self._slots = []  # owned by the RankSlots (released with them, on every rank)
            return
        super()._drop_slots(timeout, detach)

    def _wait_slot(self, slot, timeout: float) -> None:
        super()._wait_slot(slot, timeout)
        if self._mode == "per_rank" and slot.last_bucket in self.keep.outstanding():
            self.keep.release(slot.last_bucket)  # every engine replied: the slot may be packed again

    def _before_commit(self) -> None:
        if self._mode == "per_rank":
            self.keep.check_finished()

    def abort(self, reason: str, timeout: float) -> None:
        try:
            super().abort(reason, timeout)
        finally:
            self.keep.release_all()

    def _packer_checksums(self) -> bool:
        return self._mode == "staged"

    def _send(self, bucket: BucketLayout, timeout: float) -> None:
        slot = self._slot(bucket.index)
        if self._mode == "per_rank":
            self._send_per_rank(slot, bucket, timeout)
            return
        if self._mode == "staged":
            self._checksum_into_trailer(slot, bucket)
            if slot.sender_event is not None:
                slot.sender_event.record(torch.cuda.current_stream(self.device))
            slot.pending = self._issue("load_staged_bucket", timeout, slot.index, bucket.index)
            return
        slot.last_bucket = bucket.index
        slot.pending = self._issue("update_weights_from_tensor", timeout, self._flat_bucket(slot, bucket))

    def _flat_bucket(self, slot, bucket: BucketLayout) -> FlatBucket:
        """The packed slot as SGLang's payload (its checksum read on the host: this also orders the pack)."""
        payload = slot.payload(bucket.nbytes)
        return FlatBucket(payload, list(bucket.metas), index=bucket.index,
                          checksum=checksum_values(bucket_checksum(payload)))

    def _send_per_rank(self, slot, bucket: BucketLayout, timeout: float) -> None:
        """Each engine gets its own entries (the slots of the trainer ranks on its devices), all with the
        shipping rank's checksum of the bucket (read on the host: this also orders the pack)."""
        payload = slot.payload(bucket.nbytes)
        checksum = checksum_values(bucket_checksum(payload))
        self.keep.hold(bucket.index, slot.buffer)
        slot.last_bucket = bucket.index
        self._touched = True
        slot.pending = [(label, r.call_async("update_weights_from_tensor", timeout, RankedFlatBucket(
                            self.rank_slots.entries(bucket, self.colocations[r.name]), list(bucket.metas),
                            bucket.index, checksum)))
                        for label, r in zip(self.labels, self.receivers)]
