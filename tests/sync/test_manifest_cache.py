"""The manifest by digest: a receiver keeps the `full` layouts it validated (`ManifestCache`), so the sender ships a
later session of the same layout as a digest-only `SyncManifest.reference()`. A receiver that does not know the
digest refuses it clearly (and the transport then sends the full manifest); a digest that does not name its layout
is refused; copy targets are looked up afresh every session (a parameter's storage may be replaced between syncs)."""

import pickle

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.manifest import SyncManifest
from beamrl.protocols.weights import PendingCall, WeightSyncError
from beamrl.sync.export import StateDictSource
from beamrl.sync.forwarding_receiver import ForwardingReceiver
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
from beamrl.sync.packing import pack_session
from beamrl.sync.transports import TRANSPORTS

from .conftest import perturb

T = 30.0
TIMEOUTS = SyncTimeouts.uniform(30)


class RecordingReceiver(LocalWeightReceiver):
    """The in-process receiver, recording every manifest it is offered and whether it accepted it."""

    def __init__(self, model, name="eng"):
        super().__init__(model, name=name)
        self.offered: list[tuple[SyncManifest, bool]] = []

    def begin_weight_update(self, manifest, timeout):
        try:
            super().begin_weight_update(manifest, timeout)
        except WeightSyncError:
            self.offered.append((manifest, False))
            raise
        self.offered.append((manifest, True))


def _model(seed):
    torch.set_num_threads(1)
    return BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=seed).eval()


def _same_as(model, other):
    theirs = dict(other.named_parameters())
    return all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())


def _sync(receiver, staged=None):
    return WeightSync(TRANSPORTS.get("colocated")([receiver], staged=staged), [receiver], bucket_bytes=64 * 1024,
                      timeouts=TIMEOUTS, initial_version=receiver.weight_version, progress=None)


def test_second_sync_of_the_same_layout_ships_only_the_digest():
    trainer, engine = _model(1), _model(0)
    receiver = RecordingReceiver(engine)
    sync = _sync(receiver)
    try:
        for step in range(3):
            perturb(trainer, seed=step)
            sync.sync(StateDictSource.of_model(trainer))
            assert _same_as(engine, trainer) and receiver.weight_version == step + 1
    finally:
        sync.close()
    (first, ok1), (second, ok2), (third, ok3) = receiver.offered
    assert ok1 and ok2 and ok3
    assert not first.is_reference and len(first.buckets) > 3
    assert second.is_reference and third.is_reference and second.digest == third.digest == first.digest
    assert (second.version, third.version) == (2, 3)
    assert len(pickle.dumps(second)) * 20 < len(pickle.dumps(first))  # what crosses to an engine process


def test_receiver_that_does_not_know_the_digest_refuses_it_and_is_sent_the_full_manifest():
    trainer = _model(1)
    manifest, _ = pack_session(list(trainer.named_parameters()), 1, 64 * 1024)
    engine = _model(0)
    snapshot = {n: p.detach().clone() for n, p in engine.named_parameters()}
    fresh = RecordingReceiver(engine)
    with pytest.raises(WeightSyncError, match=r"eng: unknown manifest layout .*sent by digest only.*send the full"):
        fresh.begin_weight_update(manifest.reference(), T)
    assert not fresh.in_session and fresh.weight_version == 0
    assert all(torch.equal(p, snapshot[n]) for n, p in engine.named_parameters())



class _Proxy(ForwardingReceiver):
    """A proxy in front of an in-process receiver (`inner`, replaceable: a restart behind the same proxy): calls run
    when issued, so in issue order, and `begin` is only issued by the transport, its answer taken later."""

    def __init__(self, inner):
        self.inner = inner

    name = property(lambda self: self.inner.name)
    weight_version = property(lambda self: self.inner.weight_version)
    tp_size = 1

    def _submit(self, method, timeout, *args):
        try:
            return PendingCall(result=getattr(self.inner, method)(*args, timeout))
        except WeightSyncError as exc:
            return PendingCall(error=exc)


@pytest.mark.parametrize("proxied", [False, True])
def test_an_engine_restarted_behind_the_same_proxy_is_sent_the_full_manifest(proxied):
    """The sender's side: an engine restarted behind the same proxy no longer holds the layout; it refuses the
    digest and gets the full manifest, whether `begin` was waited for (threads) or only issued (a proxy)."""
    trainer, engine = _model(1), _model(0)
    first = RecordingReceiver(_model(0))
    receiver = _Proxy(first) if proxied else first
    sync = _sync(receiver, staged=False)  # SGLang's payloads: no slots to re-share
    try:
        sync.sync(StateDictSource.of_model(trainer))
        restarted = RecordingReceiver(engine, name="eng")
        restarted.weight_version = 1
        if proxied:
            receiver.inner = restarted
        else:
            sync.transport.receivers[0] = restarted
            sync.engines[0] = restarted
        perturb(trainer, seed=5)
        report = sync.sync(StateDictSource.of_model(trainer))
    finally:
        sync.close()
    assert report.version == 2 == restarted.weight_version and _same_as(engine, trainer)
    assert [(m.is_reference, ok) for m, ok in restarted.offered] == [(True, False), (False, True)]


def test_a_known_digest_still_refuses_a_stale_version():
    trainer, engine = _model(1), _model(0)
    receiver = LocalWeightReceiver(engine, name="eng", initial_version=0)
    manifest, buckets = pack_session(list(trainer.named_parameters()), 3, 64 * 1024)
    receiver.begin_weight_update(manifest, T)
    for b in buckets:
        receiver.update_weights_from_tensor(b, T)
    receiver.end_weight_update(3, T)
    with pytest.raises(WeightSyncError, match="stale weight version"):
        receiver.begin_weight_update(manifest.with_version(3).reference(), T)
    assert not receiver.in_session and receiver.weight_version == 3


def test_a_digest_that_does_not_name_its_layout_is_refused():
    trainer = _model(1)
    named = list(trainer.named_parameters())
    manifest, _ = pack_session(named, 1, 64 * 1024)
    other, _ = pack_session(named, 1, 32 * 1024)  # same tensors, other buckets: another digest
    assert other.digest != manifest.digest
    forged = SyncManifest(1, manifest.mode, manifest.buckets, other.digest)
    receiver = LocalWeightReceiver(_model(0), name="eng")
    with pytest.raises(WeightSyncError, match="eng: the manifest's digest .* is not that of its layout"):
        receiver.begin_weight_update(forged, T)
    assert not receiver.in_session


def test_copy_targets_are_looked_up_afresh_each_session():
    """A parameter's storage replaced between syncs (what a memory release/resume does on GPU) gets the next sync."""
    trainer, engine = _model(1), _model(0)
    receiver = LocalWeightReceiver(engine, name="eng")
    sync = _sync(receiver)
    try:
        sync.sync(StateDictSource.of_model(trainer))
        for p in engine.parameters():
            p.data = p.data.clone()  # new storage, same Parameter objects
        perturb(trainer, seed=9)
        sync.sync(StateDictSource.of_model(trainer))
    finally:
        sync.close()
    assert _same_as(engine, trainer)


def test_manifest_pickles_to_an_equal_manifest():
    manifest, _ = pack_session(list(_model(1).named_parameters()), 7, 64 * 1024)
    back = pickle.loads(pickle.dumps(manifest))
    assert back == manifest and back.tensors == manifest.tensors
    assert SyncManifest.build(back.version, back.mode, back.buckets).digest == manifest.digest


def test_the_reference_crosses_to_an_engine_in_its_own_process(tiny_checkpoint):
    """As in training (the engine behind a process boundary): the second sync sends the digest only, the engine
    resolves it and the synced weights score like the trainer's (1e-4, float32)."""
    from beamrl.rollout.native.config import NativeEngineConfig
    from beamrl.rollout.native.engine import NativeEngine
    from beamrl.sync.orchestrator import ProbeCheck
    from beamrl.sync.process_receiver import HostedEngine

    class RecordingHosted(HostedEngine):
        def _submit(self, method, timeout, *args):  # every call to the child, issued or waited for
            if method == "begin_weight_update":
                self.offered = [*getattr(self, "offered", []), args[0]]
            return super()._submit(method, timeout, *args)

    cfg = NativeEngineConfig(model_path=tiny_checkpoint, dtype="float32", device="cpu", name="hosted")
    engine = RecordingHosted(NativeEngine, (cfg,), name="hosted")
    trainer = _model(0)
    probes = [[1, 5, 9, 200, 17, 3, 88, 41, 2, 9]]
    sync = WeightSync(TRANSPORTS.get("colocated")([engine]), [engine], bucket_bytes=64 * 1024, timeouts=TIMEOUTS,
                      probe=ProbeCheck(probes, tolerance=1e-4), progress=None)
    try:
        for seed in (1, 2):
            perturb(trainer, seed=seed)
            report = sync.sync(StateDictSource.of_model(trainer))
            assert report.verified and report.max_abs_logprob_diff <= 1e-4
        assert [m.is_reference for m in engine.offered] == [False, True] and engine.weight_version == 2
    finally:
        sync.close()
        engine.shutdown()
