"""Failure policy shared by all transports: dead, wedged or refusing engines fail fast with their name and
message; `abort` asks every engine to abort its session, and an engine that cannot, or that stops serving, is
marked unhealthy (never half-updated and silent)."""

import time

import pytest
import torch

from beamrl.protocols.weights import PendingCall, WeightSyncError
from beamrl.sync.forwarding_receiver import ForwardingReceiver
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.packing import pack_bucket
from beamrl.sync.plan import plan_buckets
from beamrl.sync.export import specs_of
from beamrl.sync.transports import TRANSPORTS

from ..conftest import RefusingReceiver, WedgedReceiver, hosted_native_engine


def session(model, version=1, bucket_bytes=1 << 15):
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    plan = plan_buckets([specs_of(named)], bucket_bytes)
    return plan.manifest(version, "full"), dict(plan.assemble([named]))


def send(transport, manifest, tensors, index, timeout):
    layout = manifest.bucket(index)
    target = transport.buffer(layout, timeout)
    pack_bucket(target.buffer, layout, tensors[index], target.views)
    transport.send(layout, timeout)


def test_dead_engine_fails_fast_with_its_name(tiny_checkpoint, trainer_model):
    engine = hosted_native_engine(tiny_checkpoint, "doomed-engine")
    try:
        transport = TRANSPORTS.get("colocated")([engine])
        transport.connect(10)
        engine.kill()
        manifest, _ = session(trainer_model)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"doomed-engine: .*receiver process is (dead|gone)"):
            transport.begin(manifest, timeout=600)
        assert time.monotonic() - t0 < 120  # noticed as dead, not by the 600 s deadline
        transport.abort("engine died", timeout=5)
        assert "doomed-engine" in transport.unhealthy
        with pytest.raises(WeightSyncError, match="refusing to sync.*doomed-engine"):
            transport.begin(manifest, timeout=5)
    finally:
        engine.shutdown()


def test_wedged_engine_times_out_and_is_marked_unhealthy_the_other_rolls_back(trainer_model):
    healthy_model = type(trainer_model)(trainer_model.config, dtype=torch.float32, seed=3)
    before = {n: p.clone() for n, p in healthy_model.named_parameters()}
    healthy = LocalWeightReceiver(healthy_model, name="healthy")
    wedged = WedgedReceiver(trainer_model, wedge_on="load_staged_bucket", name="wedged")
    try:
        transport = TRANSPORTS.get("colocated")([healthy, wedged])
        manifest, tensors = session(trainer_model)
        transport.begin(manifest, timeout=5)
        send(transport, manifest, tensors, 0, timeout=5)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"wedged: no reply to load_staged_bucket within 1 s"):
            transport.finalize(timeout=1.0)
        assert time.monotonic() - t0 < 60  # the wedged call is abandoned at its deadline
        transport.abort("bucket 0 timed out", timeout=1.0)
        assert set(transport.unhealthy) == {"wedged"}  # cannot abort its session: restart it
        assert "did not abort its session cleanly" in transport.unhealthy["wedged"]
        # the healthy engine had loaded bucket 0; it rolled back and keeps serving its previous weights
        assert healthy.failure is None and healthy.weight_version == 0
        assert all(torch.equal(p, before[n]) for n, p in healthy_model.named_parameters())
    finally:
        wedged.release.set()


def test_abort_rolls_back_or_marks_unhealthy(trainer_model):
    rolls_back = LocalWeightReceiver(type(trainer_model)(trainer_model.config, dtype=torch.float32, seed=3),
                                     name="undo", rollback=True)
    cannot = LocalWeightReceiver(type(trainer_model)(trainer_model.config, dtype=torch.float32, seed=4),
                                 name="no-undo", rollback=False)
    transport = TRANSPORTS.get("colocated")([rolls_back, cannot])
    manifest, tensors = session(trainer_model)
    transport.begin(manifest, timeout=5)
    send(transport, manifest, tensors, 0, timeout=5)
    transport.abort("a later bucket failed", timeout=5)
    assert set(transport.unhealthy) == {"no-undo"} and "does not serve" in transport.unhealthy["no-undo"]
    assert rolls_back.failure is None and cannot.failure is not None
    assert not rolls_back.in_session and not cannot.in_session and transport.manifest is None


def test_engine_reply_success_false_raises_with_its_message(trainer_model):
    transport = TRANSPORTS.get("colocated")([RefusingReceiver(trainer_model, name="sgl-0")])
    manifest, tensors = session(trainer_model)
    transport.connect(5)
    assert transport.mode == "flattened_bucket"
    transport.begin(manifest, timeout=5)
    send(transport, manifest, tensors, 0, timeout=5)
    with pytest.raises(WeightSyncError, match="sgl-0: Failed to update parameter online: shape mismatch"):
        transport.finalize(timeout=5)


def test_session_misuse_is_refused(trainer_model):
    receiver = LocalWeightReceiver(trainer_model, name="eng")
    transport = TRANSPORTS.get("colocated")([receiver])
    manifest, tensors = session(trainer_model)
    with pytest.raises(WeightSyncError, match="outside a sync session"):
        transport.buffer(manifest.bucket(0), timeout=5)
    transport.begin(manifest, timeout=5)
    with pytest.raises(WeightSyncError, match="still open"):
        transport.begin(manifest, timeout=5)
    for k in range(len(manifest.buckets)):
        send(transport, manifest, tensors, k, timeout=5)
    assert receiver.weight_version == 0  # the version changes only when the session ends
    transport.finalize(timeout=5)
    assert receiver.weight_version == 1 and not transport.unhealthy


class _IssueOrderProxy(ForwardingReceiver):
    """An engine behind an ordered channel (as the Ray and pipe proxies): calls run when issued, `begin` is only
    issued by the transport and its answer taken later. Records the methods that reached the engine."""

    tp_size = 1

    def __init__(self, inner):
        self.inner, self.reached = inner, []

    name = property(lambda self: self.inner.name)
    weight_version = property(lambda self: self.inner.weight_version)

    def _submit(self, method, timeout, *args):
        self.reached.append(method)
        try:
            return PendingCall(result=getattr(self.inner, method)(*args, timeout))
        except WeightSyncError as exc:
            return PendingCall(error=exc)


@pytest.mark.parametrize("staged", [True, False])
def test_no_bucket_goes_out_before_every_engine_accepted_the_manifest(trainer_model, staged):
    """`begin` only issues the engines' begin calls where they run in issue order; `send` (the base class's, for
    every transport) takes their answers first, so an engine refusing the manifest fails the send, naming it,
    and no bucket reaches any engine."""
    refusing = _IssueOrderProxy(LocalWeightReceiver(trainer_model, name="stale-eng", initial_version=5))
    other = _IssueOrderProxy(LocalWeightReceiver(type(trainer_model)(trainer_model.config, dtype=torch.float32,
                                                                     seed=3), name="ok-eng"))
    transport = TRANSPORTS.get("colocated")([other, refusing], staged=staged)
    manifest, tensors = session(trainer_model)
    transport.begin(manifest, timeout=5)  # issued, not answered: returns although one engine refuses
    with pytest.raises(WeightSyncError, match=r"stale-eng: .*version"):
        send(transport, manifest, tensors, 0, timeout=5)
    loads = {"load_staged_bucket", "update_weights_from_tensor"}
    assert [m for m in refusing.reached + other.reached if m in loads] == []
    transport.abort("begin refused", timeout=5)


def test_duplicate_engine_names_get_distinct_labels(trainer_model):
    a = LocalWeightReceiver(trainer_model, name="sglang")
    b = RefusingReceiver(trainer_model, name="sglang")
    transport = TRANSPORTS.get("colocated")([a, b], staged=False)
    manifest, tensors = session(trainer_model)
    transport.begin(manifest, timeout=5)
    send(transport, manifest, tensors, 0, timeout=5)
    with pytest.raises(WeightSyncError, match="sglang#1: Failed"):
        transport.finalize(timeout=5)


def test_unknown_transport_lists_allowed_names():
    with pytest.raises(KeyError, match="allowed: colocated, disk, distributed"):
        TRANSPORTS.get("rdma")


def test_cached_packing_views_belong_to_their_layout_not_to_its_id(trainer_model):
    """A staging slot caches packing views per layout. Ids of freed layouts are reused (on the H200 a second bucket
    size was packed with the first one's views: "got 2 and 20" tensors), so a cached entry whose layout is another
    object under the same id must not be used: the sync lands exactly."""
    from beamrl.sync.packing import bucket_views

    receiver = LocalWeightReceiver(trainer_model, name="eng")
    transport = TRANSPORTS.get("colocated")([receiver])
    small, _ = session(trainer_model, bucket_bytes=1 << 13)
    manifest, tensors = session(trainer_model, bucket_bytes=1 << 15)
    k = next(i for i, (a, b) in enumerate(zip(small.buckets, manifest.buckets)) if a.metas != b.metas)
    transport.begin(manifest, timeout=5)
    slot = transport._slot(k)
    stale = small.bucket(k)  # what a freed layout that had this id left behind
    slot.views[id(manifest.bucket(k))] = (stale, bucket_views(slot.buffer, stale))
    for k in range(len(manifest.buckets)):
        send(transport, manifest, tensors, k, timeout=5)
    transport.finalize(timeout=5)
    assert receiver.weight_version == 1
    named = dict(trainer_model.named_parameters())
    for k, ts in tensors.items():
        for meta, t in zip(manifest.bucket(k).metas, ts):
            assert torch.equal(named[meta.name].detach(), t), meta.name


def test_small_buckets_get_more_staging_slots_within_the_budget():
    from beamrl.sync.transports.base import STAGING_BUDGET_BYTES, auto_staging_slots

    assert auto_staging_slots(STAGING_BUDGET_BYTES) == 2  # large buckets: double buffering
    assert auto_staging_slots(STAGING_BUDGET_BYTES // 3) == 3
    assert auto_staging_slots(64 << 20) == 4 and auto_staging_slots(1) == 4  # never more than 4
