"""Exact verification with the embedded engine in its own process (as in training): the verification scenarios of
`verification.py`, and the policy without an undo log (GPU default): a bad bucket after good ones leaves the engine
unhealthy (it refuses to serve, the transport refuses to sync to it) until its weights are reloaded."""

import pytest

from beamrl.protocols.weights import WeightSyncError
from beamrl.rollout.native.config import NativeEngineConfig
from beamrl.rollout.native.engine import NativeEngine
from beamrl.sync.export import StateDictSource
from beamrl.sync.orchestrator import WeightSync
from beamrl.sync.process_receiver import HostedEngine

from .conftest import perturb
from .faults import FlippedBit
from .verification import PROBES, TIMEOUTS, manifest_faults, transit_faults

BUCKET = 256 * 1024


@pytest.fixture
def new_weights(trainer_model):
    perturb(trainer_model, seed=11)
    return [(n, p.detach()) for n, p in trainer_model.named_parameters()]


def test_manifest_faults_are_refused_before_anything_is_applied(hosted_engine, new_weights):
    manifest_faults(hosted_engine, new_weights, BUCKET)


def test_faults_in_transit_are_refused_and_rolled_back(hosted_engine, new_weights):
    transit_faults(hosted_engine, new_weights, BUCKET)


def test_without_rollback_a_bad_bucket_leaves_the_engine_unhealthy_until_reloaded(tiny_checkpoint, new_weights):
    engine = HostedEngine(NativeEngine, (NativeEngineConfig(model_path=tiny_checkpoint, name="no-undo",
                                                            rollback=False),), name="no-undo")
    try:
        before = engine.weights_checksum(60)
        sync = WeightSync(lambda r: FlippedBit(r, bad=2), [engine], bucket_bytes=BUCKET, timeouts=TIMEOUTS,
                          progress=None)
        with pytest.raises(WeightSyncError, match="bucket 2 failed its checksum"):
            sync.sync(StateDictSource(new_weights))
        assert "no-undo" in sync.transport.unhealthy and engine.weight_version == 0
        with pytest.raises(WeightSyncError, match="not serving .*partly updated"):
            engine.score(PROBES, 60)
        with pytest.raises(WeightSyncError, match="refusing to sync.*no-undo"):
            sync.sync(StateDictSource(new_weights))
        engine.update_weights_from_disk(tiny_checkpoint, 60)  # "restart with current weights"
        assert engine.weights_checksum(60) == before and len(engine.score(PROBES, 60)) == 2
        sync.close()
    finally:
        engine.shutdown()
