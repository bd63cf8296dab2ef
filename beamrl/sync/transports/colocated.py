"""Colocated transport: engines on the trainer's node read each bucket from the trainer's memory.

Two ways, chosen at `connect` from what the receivers support:
- **staged** (the native engine, in-process or in its own process): `StagingSlot`s shared once (CUDA-IPC on GPU,
  shared memory on CPU); per bucket the trainer packs into slot `k % slots`, writes the bucket's checksum into the
  slot's trailer on the device, records one CUDA event, and sends `(slot, k)`; the engine waits on that event,
  checks the checksum and copies out with one batched copy, then records its own event. No host round trip per
  bucket on either side; the trainer waits for a slot only when it packs into it again.
- **flattened bucket** (SGLang's contract): the same packed bytes go as one `FlatBucket` (index, host checksum)
  through `update_weights_from_tensor`; the SGLang adapter serializes it as SGLang's `flattened_bucket` payload,
  one per engine TP rank (CUDA-IPC handles on GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from beamrl.protocols.checksum import bucket_checksum, checksum_values
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.manifest import BucketLayout
from beamrl.protocols.weights import WeightReceiver
from beamrl.sync.calls import run_concurrently
from beamrl.sync.transports import TRANSPORTS
from beamrl.sync.transports.base import ReceiverTransport


@TRANSPORTS.register("colocated")
class ColocatedTransport(ReceiverTransport):
    """Staged buckets where every receiver supports them, else `flattened_bucket` payloads (module docstring)."""

    name = "colocated"

    def __init__(self, receivers: Sequence[WeightReceiver], device: str | torch.device = "cpu",
                 staging_slots: int | None = None, staged: bool | None = None) -> None:
        """`staged`: force (True) or forbid (False) staged buckets; None: use them if every receiver can."""
        super().__init__(receivers, device=device, staging_slots=staging_slots)
        self._staged = staged
        self._mode: str | None = None

    @property
    def mode(self) -> str | None:
        """'staged' or 'flattened_bucket' once connected."""
        return self._mode

    def connect(self, timeout: float) -> None:
        if self._mode is not None:
            return
        self._require_healthy()
        staged = self._staged
        if staged is None:
            answers: dict[int, bool] = {}

            def ask(i: int, r: WeightReceiver) -> None:
                answers[i] = bool(r.staging_supported(timeout))

            run_concurrently("staging_supported", [(label, (lambda i=i, r=r: ask(i, r)))
                                                   for i, (label, r) in enumerate(zip(self.labels, self.receivers))],
                             timeout)
            staged = all(answers.values())
        self._mode = "staged" if staged else "flattened_bucket"

    def _use_shared_slots(self, timeout: float) -> bool:
        self.connect(timeout)
        return self._mode == "staged"

    def send(self, bucket: BucketLayout, timeout: float) -> None:
        self._require_session("send")
        slot = self._slot(bucket.index)
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
