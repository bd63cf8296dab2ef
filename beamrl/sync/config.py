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


def buckets_from_every_rank(transport: str, placement_mode: str, num_nodes: int, engine_tps: list[int]) -> bool:
    """Whether colocated engines take their buckets from every trainer rank (per-rank buckets, docs/colocated.md):
    an engine of TP > 1 (its ranks are on several devices), or a layout of several nodes (an engine on another node
    than trainer rank 0 cannot open rank 0's buffers). Otherwise rank 0 ships every bucket. The one rule for the
    run (`loop.weight_update.rank_colocations`) and the sync-time model (`recipe.sync_time`)."""
    return (transport == "colocated" and placement_mode == "colocated"
            and (num_nodes > 1 or any(tp > 1 for tp in engine_tps)))
