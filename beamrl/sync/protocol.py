"""The trainer side of the weight-sync seam: transports that carry the streaming HF export to the engines.

Lifecycle of one sync: `connect` (once) -> `begin(version)` -> `send_bucket` * N -> `finalize()`.
`send_adapter` is reserved for adapter-only (LoRA) syncs, which push merged tensors of the targeted modules.
A transport raises `beamrl.protocols.weights.WeightSyncError` with the engine's message; after a failure the engine
must not go on serving a half-updated model silently (the transport aborts the session and marks the engine
unhealthy).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class Bucket:
    """Full HF-named tensors that travel together (<= the configured bucket size, except one oversized tensor).

    Tensors that SGLang fuses on load (q/k/v/gate, gate/up, router weight + correction bias) share a bucket."""

    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class WeightTransport(abc.ABC):
    """Moves buckets of HF tensors into one or more engines."""

    name: str = "abstract"

    @abc.abstractmethod
    def connect(self, timeout: float) -> None:
        """Set up channels (e.g. the NCCL/gloo update group). Idempotent."""

    @abc.abstractmethod
    def begin(self, version: int, timeout: float) -> None:
        """Open the engines' weight-update session for `version` (engines paused and idle)."""

    @abc.abstractmethod
    def send_bucket(self, bucket: Bucket, timeout: float) -> None:
        """Ship one bucket; raise `WeightSyncError` on any engine failure."""

    def send_adapter(self, bucket: Bucket, timeout: float) -> None:
        """Adapter-only sync: merged BF16 tensors of the LoRA-targeted modules (a partial update)."""
        self.send_bucket(bucket, timeout)

    @abc.abstractmethod
    def finalize(self, timeout: float) -> None:
        """Close the session, set the engines' weight version, flush caches."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Leave the session after a failure; the engines are marked as not serving the new version."""

    def close(self) -> None:
        """Tear down channels."""
