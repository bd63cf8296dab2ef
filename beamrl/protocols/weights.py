"""The engine side of the weight-sync seam: what a rollout engine implements to receive weights.

`WeightReceiver` mirrors SGLang 0.5.23's RL endpoints, so the SGLang engines and the native engine are
interchangeable behind the trainer-side transports (`beamrl.sync`). It lives here, beside the rollout protocol,
so that neither `beamrl.rollout` nor `beamrl.sync` has to import the other.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beamrl.protocols.flat_bucket import FlatBucket


class WeightSyncError(RuntimeError):
    """A weight sync failed or timed out; the message names the engine and its reply."""



class WeightReceiver(abc.ABC):
    """Engine-side weight-update API that transports drive; mirrors SGLang 0.5.23's RL endpoints
    (sglang-integration.md §4) so the SGLang engines and the native engine are interchangeable.

    Every method raises `WeightSyncError` (with the engine's message) on `success=False` or timeout."""

    @property
    def name(self) -> str:
        """Engine name used in error messages (override with e.g. 'sglang-0@host:port')."""
        return type(self).__name__

    @property
    @abc.abstractmethod
    def tp_size(self) -> int:
        """Number of engine TP ranks (one colocated payload per rank)."""

    @abc.abstractmethod
    def begin_weight_update(self, timeout: float) -> None: ...

    @abc.abstractmethod
    def update_weights_from_tensor(self, bucket: "FlatBucket", timeout: float) -> None:
        """Colocated path: one flattened bucket (`beamrl.protocols.flat_bucket.FlatBucket`). The SGLang adapter
        serializes it into SGLang's `flattened_bucket` payload, one per engine TP rank (CUDA-IPC handles on
        GPU); the native engine unflattens it in place. flush_cache=False per bucket."""

    @abc.abstractmethod
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str, timeout: float) -> None: ...

    @abc.abstractmethod
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, timeout: float) -> None:
        """`load_format="flattened_bucket"`: one uint8 broadcast from rank 0 of the group per bucket, laid
        out as `FlatBucket` lays it out (identical to SGLang's `FlattenedTensorBucket`). The receiver joins
        the broadcast; the caller (rank 0) broadcasts concurrently."""

    @abc.abstractmethod
    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None: ...

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, timeout: float) -> None: ...

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        """Set the served weight version outside a session (after `update_weights_from_disk`; SGLang:
        `POST /update_weight_version`). Added by the weight-sync work; receivers that support the disk
        transport override it."""
        raise WeightSyncError(f"{self.name}: update_weight_version is not implemented, so the disk transport "
                              f"cannot version this engine")

    @abc.abstractmethod
    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Close the session, set the served weight version and flush the prefix cache."""
