"""The weight-receiver contract every receiver must meet (SGLang 0.5.23's session rules plus the manifest). Run
against the real SGLang CPU engine, the native engine and the in-process `LocalWeightReceiver` that the test fakes
build on, so the fakes cannot drift from the real engines."""

from __future__ import annotations

import pytest
import torch

from beamrl.protocols.weights import UNTOUCHED, WeightReceiver, WeightSyncError
from beamrl.sync.packing import pack_session


def current_weights_session(model: torch.nn.Module, version: int, bucket_bytes: int = 1 << 16):
    """A full session re-sending the weights the engine already serves (a no-op update): (manifest, buckets)."""
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    return pack_session(named, version, bucket_bytes)


def check_receiver_contract(receiver: WeightReceiver, version_of, model: torch.nn.Module, timeout: float = 60) -> None:
    """`version_of()` reads the served weight version; `model` holds the weights the receiver serves."""
    v0 = version_of()
    manifest, buckets = current_weights_session(model, v0 + 1)
    assert receiver.tp_size >= 1 and len(buckets) > 1
    with pytest.raises(WeightSyncError, match=r"begin_weight_update\(\).*end_weight_update\(\)"):
        receiver.update_weights_from_tensor(buckets[0], timeout)  # outside a session
    with pytest.raises(WeightSyncError, match="no weight-update session is open"):
        receiver.end_weight_update(v0 + 5, timeout)
    assert receiver.abort_weight_update("nothing to abort", timeout) == UNTOUCHED
    receiver.begin_weight_update(manifest, timeout)
    with pytest.raises(WeightSyncError, match="already open"):
        receiver.begin_weight_update(manifest, timeout)
    for b in buckets:
        receiver.update_weights_from_tensor(b, timeout)
    assert version_of() == v0  # bumped only when the session ends
    receiver.end_weight_update(v0 + 1, timeout)
    assert version_of() == v0 + 1
    assert receiver.served_weight_version(timeout) == v0 + 1
