"""`SyncConfig`: the recipe's `sync` section (trainer -> engine weight sync; its timeout is timeouts.sync_s)."""

from __future__ import annotations

from pydantic import Field

from beamrl.config import Section, registry_choice
from beamrl.sync.transports import TRANSPORTS


class SyncConfig(Section):
    """transport: a `TRANSPORTS` name. bucket_mb: bucket size in MiB (one oversized tensor may exceed it).
    verify: after a sync, compare the engines' logprobs on short probe sequences with the trainer's (on the first
    sync, then every `probe_every`-th; the per-bucket checksums are checked on every sync regardless)."""

    transport: registry_choice(TRANSPORTS) = "colocated"  # type: ignore[valid-type]
    bucket_mb: int = Field(512, gt=0)
    verify: bool = True
    probe_every: int = Field(1, ge=1)

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20
