"""The weight-receiver contract every receiver must meet (SGLang 0.5.23's session rules). Run against the
real SGLang CPU engine, the native engine and the in-process `LocalWeightReceiver` that the test fakes build on,
so the fakes cannot drift from the real engines."""

from __future__ import annotations

import pytest
import torch

from beamrl.protocols.flat_bucket import FlatBucket, aligned_order
from beamrl.protocols.weights import WeightReceiver, WeightSyncError


def current_weights_bucket(model: torch.nn.Module, n: int = 6) -> FlatBucket:
    """A bucket re-sending some of the weights the engine already serves (a no-op update)."""
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()][:n]
    return FlatBucket.from_named_tensors(aligned_order(named))


def check_receiver_contract(receiver: WeightReceiver, version_of, model: torch.nn.Module, timeout: float = 60) -> None:
    """`version_of()` reads the served weight version; `model` holds the weights the receiver serves."""
    bucket = current_weights_bucket(model)
    v0 = version_of()
    assert receiver.tp_size >= 1
    with pytest.raises(WeightSyncError, match=r"begin_weight_update\(\).*end_weight_update\(\)"):
        receiver.update_weights_from_tensor(bucket, timeout)  # outside a session
    with pytest.raises(WeightSyncError, match="no weight-update session is open"):
        receiver.end_weight_update(v0 + 5, timeout)
    receiver.begin_weight_update(timeout)
    with pytest.raises(WeightSyncError, match="already open"):
        receiver.begin_weight_update(timeout)
    receiver.update_weights_from_tensor(bucket, timeout)
    assert version_of() == v0  # bumped only when the session ends
    receiver.end_weight_update(v0 + 1, timeout)
    assert version_of() == v0 + 1
