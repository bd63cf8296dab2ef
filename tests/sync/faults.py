"""Fault injectors for verification tests: the real transports with one step changed after the sender's checks, as
a fault in transit would change it (the receivers under test are the real engines); and in-process receivers with
one reply changed, as a faulty engine would answer after a sync."""

from __future__ import annotations

from beamrl.protocols.flat_bucket import FlatBucket, TensorMeta
from beamrl.sync.export import StateDictSource
from beamrl.sync.local_receiver import LocalWeightReceiver
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


class NaNScores(LocalWeightReceiver):
    """Scores the probes with its model, one logprob NaN (an engine whose forward overflowed after the sync)."""

    def score(self, seqs, timeout):
        logprobs = StateDictSource.of_model(self.model).logprobs(seqs)
        logprobs[0][0] = float("nan")
        return logprobs


class StaleAfterCommit(LocalWeightReceiver):
    """Commits the session but reports the version it served before it (an engine that kept the old weights)."""

    def begin_weight_update(self, manifest, timeout):
        self.before = self.weight_version
        super().begin_weight_update(manifest, timeout)

    def served_version_after_commit(self, timeout):
        return self.before
