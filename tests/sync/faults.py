"""Fault injectors for verification tests: the real transports with one step changed after the sender's checks, as
a fault in transit would change it (the receivers under test are the real engines)."""

from __future__ import annotations

from beamrl.protocols.flat_bucket import FlatBucket, TensorMeta
from beamrl.sync.export import StateDictSource
from beamrl.sync.transports.colocated import ColocatedTransport


class FlippedBit(ColocatedTransport):
    """Flips one bit of bucket `bad` after its checksum was taken (staged: in the slot; flat: in the payload)."""

    def __init__(self, receivers, bad: int, **kwargs) -> None:
        super().__init__(receivers, **kwargs)
        self.bad = bad

    def _checksum_into_trailer(self, slot, bucket) -> None:
        super()._checksum_into_trailer(slot, bucket)
        if bucket.index == self.bad:
            slot.buffer[bucket.nbytes // 2] ^= 0x04

    def _flat_bucket(self, slot, bucket) -> FlatBucket:
        flat = super()._flat_bucket(slot, bucket)
        if bucket.index == self.bad:
            flat.buffer[bucket.nbytes // 2] ^= 0x04
        return flat


class Renamed(ColocatedTransport):
    """Sends bucket `bad`'s first tensor under the name `to` (flattened-bucket payloads carry names; staged buckets
    do not, so this fault exists only there)."""

    def __init__(self, receivers, bad: int, to: str, **kwargs) -> None:
        super().__init__(receivers, staged=False, **kwargs)
        self.bad, self.to = bad, to

    def _flat_bucket(self, slot, bucket) -> FlatBucket:
        flat = super()._flat_bucket(slot, bucket)
        if bucket.index == self.bad:
            m = flat.metas[0]
            flat.metas[0] = TensorMeta(self.to, m.shape, m.dtype, m.start, m.end)
        return flat


class FailsAfter(StateDictSource):
    """An export that raises after `units` units (a trainer-side error in the middle of a sync)."""

    def __init__(self, named, units: int, **kwargs) -> None:
        super().__init__(named, **kwargs)
        self.fail_after = units

    def stream(self):
        for i, unit in enumerate(super().stream()):
            if i == self.fail_after:
                raise RuntimeError(f"export failed after {i} units")
            yield unit
