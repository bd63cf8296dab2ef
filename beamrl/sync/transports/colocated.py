"""Colocated transport: each bucket becomes one `FlatBucket` passed to every engine on this node.

On GPU the SGLang adapter serializes the bucket's buffer as a CUDA-IPC handle (no copy); the buffer must stay
alive until the call returns, which it does here (the call is synchronous). On CPU the tensor is passed as is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.weights import WeightReceiver
from beamrl.sync.protocol import Bucket
from beamrl.sync.transports import TRANSPORTS
from beamrl.sync.transports.base import ReceiverTransport


@TRANSPORTS.register("colocated")
class ColocatedTransport(ReceiverTransport):
    """Flattened buckets through `update_weights_from_tensor` (SGLang `load_format="flattened_bucket"`)."""

    name = "colocated"

    def __init__(self, receivers: Sequence[WeightReceiver], device: str | torch.device | None = None) -> None:
        super().__init__(receivers)
        self.device = device  # where buckets are packed; None = where the exported tensors live

    def connect(self, timeout: float) -> None:
        """Nothing to set up: the engines share this node."""

    def send_bucket(self, bucket: Bucket, timeout: float) -> None:
        self._require_session("send_bucket")
        flat = FlatBucket.from_named_tensors(list(zip(bucket.names, bucket.tensors)), device=self.device)
        self._touched = True
        self._call_all("update_weights_from_tensor", lambda r: r.update_weights_from_tensor(flat, timeout), timeout)
