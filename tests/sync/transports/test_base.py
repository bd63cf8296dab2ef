"""Failure policy shared by all transports: dead, wedged or refusing engines fail fast with their name and
message, and every engine touched by the failed sync is left marked unhealthy (never serving half-updated)."""

import time

import pytest
import torch

from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.protocol import Bucket
from beamrl.sync.transports import TRANSPORTS

from ..conftest import hosted_native_engine, RefusingReceiver, WedgedReceiver


def one_bucket(model) -> Bucket:
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()][:5]
    return Bucket([n for n, _ in named], [t for _, t in named])


def test_dead_engine_fails_fast_with_its_name(tiny_checkpoint):
    engine = hosted_native_engine(tiny_checkpoint, "doomed-engine")
    try:
        engine.kill()
        transport = TRANSPORTS.get("colocated")([engine])
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"doomed-engine: .*receiver process is (dead|gone)"):
            transport.begin(1, timeout=5)
        assert time.monotonic() - t0 < 5
        assert "doomed-engine" in transport.unhealthy
        transport.abort("engine died")
        with pytest.raises(WeightSyncError, match="refusing to sync.*doomed-engine"):
            transport.begin(1, timeout=5)
    finally:
        engine.shutdown()


def test_wedged_engine_times_out_and_other_engines_are_marked_half_updated(trainer_model):
    healthy = LocalWeightReceiver(trainer_model.load_hf_tensors, name="healthy")
    wedged = WedgedReceiver(trainer_model, wedge_on="update_weights_from_tensor", name="wedged")
    try:
        transport = TRANSPORTS.get("colocated")([healthy, wedged])
        transport.begin(3, timeout=5)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"wedged: no reply to update_weights_from_tensor within 1 s"):
            transport.send_bucket(one_bucket(trainer_model), timeout=1.0)
        assert time.monotonic() - t0 < 3
        assert set(transport.unhealthy) == {"wedged"}
        transport.abort("bucket failed")
        # the healthy engine got the bucket but not the rest: it is half-updated too
        assert set(transport.unhealthy) == {"wedged", "healthy"}
        assert "partially updated" in transport.unhealthy["healthy"]
    finally:
        wedged.release.set()


def test_engine_reply_success_false_raises_with_its_message(trainer_model):
    transport = TRANSPORTS.get("colocated")([RefusingReceiver(trainer_model.load_hf_tensors, name="sgl-0")])
    transport.begin(1, timeout=5)
    with pytest.raises(WeightSyncError, match="sgl-0: Failed to update parameter online: shape mismatch"):
        transport.send_bucket(one_bucket(trainer_model), timeout=5)


def test_engine_load_error_comes_back_with_the_engine_words(trainer_model):
    receiver = LocalWeightReceiver(trainer_model.load_hf_tensors, name="eng")
    transport = TRANSPORTS.get("colocated")([receiver])
    transport.begin(1, timeout=5)
    bad = Bucket(["model.norm.weight"], [torch.zeros(3)])
    with pytest.raises(WeightSyncError, match=r"eng: .*'model.norm.weight' has shape \(3,\)"):
        transport.send_bucket(bad, timeout=5)


def test_session_misuse_is_refused(trainer_model):
    receiver = LocalWeightReceiver(trainer_model.load_hf_tensors, name="eng")
    transport = TRANSPORTS.get("colocated")([receiver])
    with pytest.raises(WeightSyncError, match="outside a sync session"):
        transport.send_bucket(one_bucket(trainer_model), timeout=5)
    transport.begin(1, timeout=5)
    with pytest.raises(WeightSyncError, match="still open"):
        transport.begin(2, timeout=5)
    transport.send_bucket(one_bucket(trainer_model), timeout=5)
    assert receiver.weight_version == 0  # the version changes only when the session ends
    transport.finalize(timeout=5)
    assert receiver.weight_version == 1 and not transport.unhealthy


def test_duplicate_engine_names_get_distinct_labels(trainer_model):
    a = LocalWeightReceiver(trainer_model.load_hf_tensors, name="sglang")
    b = RefusingReceiver(trainer_model.load_hf_tensors, name="sglang")
    transport = TRANSPORTS.get("colocated")([a, b])
    transport.begin(1, timeout=5)
    with pytest.raises(WeightSyncError, match="sglang#1: Failed"):
        transport.send_bucket(one_bucket(trainer_model), timeout=5)


def test_unknown_transport_lists_allowed_names():
    with pytest.raises(KeyError, match="allowed: colocated, disk, distributed"):
        TRANSPORTS.get("rdma")
