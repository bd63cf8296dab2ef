"""End to end on CPU: perturb the trainer's weights, sync them to an engine process through each transport,
then the engine's prompt logprobs must match the trainer's (fp32 parity) and its version must step by one."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.session import ProbeCheck, SyncTimeouts, WeightSyncManager
from beamrl.sync.transports import TRANSPORTS

from .conftest import perturb

PROBES = [[1, 5, 9, 200, 17, 3, 88, 41, 2, 9], [7, 7, 7, 300, 2, 511, 64]]
TIMEOUTS = SyncTimeouts(connect=60, call=30, bucket=60, verify=60)


def trainer_logprobs(model):
    def fn(seqs):
        return [model.token_logprobs(torch.tensor([s]))[0].tolist() for s in seqs]
    return fn


def export(model, chunk=25):
    """The trainer's streaming HF export: lists of (name, tensor)."""
    items = [(n, p.detach()) for n, p in model.named_parameters()]
    return [items[i:i + chunk] for i in range(0, len(items), chunk)]


def transport_kwargs(name, tmp_path):
    if name == "distributed":
        return {"device": "cpu"}
    if name == "disk":
        return {"directory": tmp_path / "sync", "config": preset("tiny").replace(dtype="float32")}
    return {}


@pytest.mark.parametrize("transport_name", ["colocated", "distributed", "disk"])
def test_perturbed_sync_matches_trainer_logprobs(transport_name, hosted_engine, trainer_model, tmp_path):
    perturb(trainer_model, seed=hash(transport_name) % 1000)
    want = trainer_logprobs(trainer_model)(PROBES)
    before = hosted_engine.score(PROBES, timeout=30)
    assert max(abs(a - b) for x, y in zip(before, want) for a, b in zip(x, y)) > 1e-3  # the sync must matter

    v0 = hosted_engine.weight_version
    transport = TRANSPORTS.get(transport_name)([hosted_engine], **transport_kwargs(transport_name, tmp_path))
    manager = WeightSyncManager(transport, engines=[hosted_engine], bucket_bytes=64 * 1024,
                                verify=ProbeCheck(PROBES, trainer_logprobs(trainer_model), tolerance=1e-4),
                                timeouts=TIMEOUTS, initial_version=v0, progress=None)
    try:
        report = manager.sync(export(trainer_model))
    finally:
        manager.close()
    assert report.version == v0 + 1 == hosted_engine.weight_version
    assert report.verified and report.max_abs_logprob_diff <= 1e-4
    assert report.bytes == sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    assert report.buckets > 3 and report.gbps > 0


def test_failed_verification_raises_and_blocks_further_syncs(hosted_engine, trainer_model):
    """A trainer/engine disagreement after a sync is an error, never a silent pass."""
    reference = trainer_logprobs(trainer_model)  # logprobs of the UNperturbed weights
    frozen = reference(PROBES)
    perturb(trainer_model, seed=77)
    manager = WeightSyncManager(TRANSPORTS.get("colocated")([hosted_engine]), engines=[hosted_engine],
                                verify=ProbeCheck(PROBES, lambda seqs: frozen, tolerance=1e-4),
                                timeouts=TIMEOUTS, initial_version=hosted_engine.weight_version, progress=None)
    with pytest.raises(WeightSyncError, match="native-engine-0: post-sync verification failed"):
        manager.sync(export(trainer_model))
    assert "native-engine-0" in manager.unhealthy
    with pytest.raises(WeightSyncError, match="refusing to sync"):
        manager.sync(export(trainer_model))


def test_empty_export_raises_before_touching_engines(hosted_engine):
    transport = TRANSPORTS.get("colocated")([hosted_engine])
    manager = WeightSyncManager(transport, timeouts=TIMEOUTS, initial_version=hosted_engine.weight_version,
                                progress=None)
    with pytest.raises(WeightSyncError, match="zero tensors"):
        manager.sync([])
    assert manager.version == hosted_engine.weight_version  # no version bump
    assert not transport.unhealthy  # refused before any engine call


def test_timeouts_must_be_finite():
    with pytest.raises(ValueError, match="SyncTimeouts.bucket"):
        SyncTimeouts(bucket=float("inf"))


def test_progress_lines_say_bucket_i_of_n_and_the_rate(trainer_model):
    from beamrl.sync.local_receiver import model_receiver

    lines = []
    receiver = model_receiver(trainer_model, name="local")
    total = sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    manager = WeightSyncManager(TRANSPORTS.get("colocated")([receiver]), bucket_bytes=256 * 1024,
                                progress=lines.append, progress_every_s=0.0)
    report = manager.sync(export(trainer_model), total_bytes=total)
    assert report.version == 1 == receiver.weight_version
    assert len(lines) == report.buckets + 1
    assert lines[0].startswith(f"[weight sync v1] bucket 1/~{-(-total // (256 * 1024))}:")
    assert "GB/s" in lines[-1] and f"in {report.buckets} buckets" in lines[-1]
