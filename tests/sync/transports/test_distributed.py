"""Distributed transport specifics: group geometry, a join that never happens fails within its timeout, a dead
engine is noticed at once, teardown is bounded, and buckets are pipelined (the next one is packed while the engines
receive this one)."""

import time
from pathlib import Path

import pytest
import torch

from beamrl.protocols.weights import WeightSyncError
from beamrl.rollout.native.config import NativeEngineConfig
from beamrl.rollout.native.engine import NativeEngine
from beamrl.sync.export import StateDictSource
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
from beamrl.sync.packing import pack_bucket
from beamrl.sync.process_receiver import HostedEngine
from beamrl.sync.transports import TRANSPORTS

from ..conftest import WedgedReceiver


class TP(LocalWeightReceiver):
    def __init__(self, name, tp):
        super().__init__(torch.nn.Linear(1, 1), name=name)
        self._tp = tp

    @property
    def tp_size(self):
        return self._tp


def test_world_size_and_rank_offsets_follow_sglang_convention():
    t = TRANSPORTS.get("distributed")([TP("a", 2), TP("b", 4), TP("c", 1)])
    assert t.world_size == 1 + 2 + 4 + 1
    assert t.rank_offsets() == [1, 3, 7]


def test_rank_offsets_and_world_size_can_come_from_outside():
    """A launcher that knows the engines' ranks (engines spanning nodes, one restarted engine) passes them."""
    t = TRANSPORTS.get("distributed")([TP("a", 2), TP("b", 2)], rank_offsets=[5, 1], world_size=7)
    assert t.world_size == 7 and t.rank_offsets() == [5, 1]
    with pytest.raises(ValueError, match="both rank_offsets and world_size"):
        TRANSPORTS.get("distributed")([TP("a", 2)], rank_offsets=[1])
    with pytest.raises(ValueError, match="1 rank_offsets for 2 receivers"):
        TRANSPORTS.get("distributed")([TP("a", 2), TP("b", 2)], rank_offsets=[1], world_size=5)


def test_nccl_needs_cuda():
    with pytest.raises(ValueError, match="nccl"):
        TRANSPORTS.get("distributed")([TP("a", 1)], device="cpu", backend="nccl")


def test_engine_that_never_joins_the_group_fails_within_timeout(trainer_model):
    wedged = WedgedReceiver(trainer_model, wedge_on="init_weights_update_group", name="engine-7")
    transport = TRANSPORTS.get("distributed")([wedged], teardown_timeout=2)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"engine-7: no reply to init_weights_update_group within 2 s"):
            transport.connect(timeout=2)
        assert time.monotonic() - t0 < 60  # the wedged engine is abandoned (it never returns until released)
        assert "engine-7" in transport.unhealthy
        with pytest.raises(WeightSyncError, match="send outside a sync session"):
            transport.send(None, timeout=1)
    finally:
        wedged.release.set()


def test_engine_killed_mid_sync_fails_fast_and_leaves_the_group(tiny_checkpoint, trainer_model):
    from ..conftest import hosted_native_engine
    from .test_base import send, session

    engine = hosted_native_engine(tiny_checkpoint, "native-doomed")
    try:
        transport = TRANSPORTS.get("distributed")([engine], teardown_timeout=2)
        transport.connect(timeout=60)
        manifest, tensors = session(trainer_model)
        transport.begin(manifest, timeout=30)
        engine.kill()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"native-doomed: .*receiver process is (dead|gone)"):
            # begin's answer is taken before the first bucket goes out, the buckets' at finalize (pipelined):
            # whichever the death cut off reports it
            send(transport, manifest, tensors, 0, timeout=600)
            transport.finalize(timeout=600)
        assert time.monotonic() - t0 < 120  # the dead engine is noticed at once, not after the 600 s timeout
        transport.abort("engine died", timeout=5)
        assert transport.group_name is None and "native-doomed" in transport.unhealthy
    finally:
        engine.shutdown(timeout=2)


class CollectiveTeardown(TP):
    """An engine whose group teardown, like NCCL's, returns only once the trainer is tearing down too."""

    def __init__(self, name, trainer_destroyed):
        super().__init__(name, 1)
        self.trainer_destroyed = trainer_destroyed

    def destroy_weights_update_group(self, group_name, timeout):
        if not self.trainer_destroyed.wait(timeout):
            raise WeightSyncError(f"{self.name}: the trainer never joined the teardown")


def test_close_tears_down_the_trainer_and_the_engines_at_once(monkeypatch):
    import threading

    from beamrl.sync.transports import distributed

    trainer_destroyed = threading.Event()
    monkeypatch.setattr(distributed, "destroy_update_group", lambda pg: trainer_destroyed.set())
    transport = TRANSPORTS.get("distributed")([CollectiveTeardown("a", trainer_destroyed),
                                               CollectiveTeardown("b", trainer_destroyed)], teardown_timeout=300)
    transport._pg, transport.group_name = object(), "beamrl-weight-update-test"  # as connect() leaves them
    t0 = time.monotonic()
    transport.close()  # engines first, trainer after: the engines would wait out the whole 300 s timeout
    assert time.monotonic() - t0 < 120
    assert trainer_destroyed.is_set() and transport._pg is None
    transport.close()  # idempotent


def test_twenty_open_sync_close_cycles_each_close_bounded(tiny_checkpoint, trainer_model):
    """Issue 12's teardown check on gloo, through what training runs (the orchestrator with a transport factory, the
    native engine in its own process): 20 cycles of a fresh update group, one verified-by-checksum sync, close.
    Every close must return (never time out) well within its bound; the times are printed."""
    from beamrl.sync.export import StateDictSource
    from beamrl.sync.orchestrator import SyncTimeouts, WeightSync

    from ..conftest import hosted_native_engine, perturb

    engine = hosted_native_engine(tiny_checkpoint, "native-cycles")
    perturb(trainer_model, seed=3)
    source = StateDictSource.of_model(trainer_model)
    closes, groups = [], set()
    try:
        for cycle in range(20):
            sync = WeightSync(lambda recs: TRANSPORTS.get("distributed")(recs, teardown_timeout=60), [engine],
                              bucket_bytes=256 * 1024, timeouts=SyncTimeouts.uniform(120),
                              initial_version=engine.weight_version, progress=None)
            report = sync.sync(source)
            assert report.version == cycle + 1 == engine.weight_version and report.buckets > 1
            groups.add(sync.transport.group_name)
            t0 = time.monotonic()
            sync.close()
            closes.append(time.monotonic() - t0)
            assert sync.transport.group_name is None
    finally:
        engine.shutdown()
    print("update-group close times (s): " + ", ".join(f"{s:.3f}" for s in closes))
    assert len(groups) == 20  # a fresh group every cycle
    assert max(closes) < 20.0, closes  # generous for a loaded CPU; the H200 target is < 2 s (issue 12)


class ReceivesBucketZeroAfterTheNextPack(NativeEngine):
    """Takes bucket 0 only once `signal` exists (the trainer writes it when it has packed bucket 1), and refuses it if
    that does not happen within 20 s: a serial transport waits for this reply before it packs bucket 1."""

    def __init__(self, config, signal: str) -> None:
        super().__init__(config)
        self.signal = Path(signal)

    def update_weights_from_distributed(self, index, checksum, group_name, timeout):
        if index == 0:
            deadline = time.monotonic() + 20
            while not self.signal.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if not self.signal.exists():
                raise WeightSyncError(f"{self.name}: bucket 1 was not packed while bucket 0 was in flight")
        return super().update_weights_from_distributed(index, checksum, group_name, timeout)


def test_the_next_bucket_is_packed_while_the_engines_receive_this_one(tiny_checkpoint, trainer_model, tmp_path):
    signal = tmp_path / "bucket-1-packed"
    cfg = NativeEngineConfig(model_path=tiny_checkpoint, dtype="float32", device="cpu", name="pipelined")
    engine = HostedEngine(ReceivesBucketZeroAfterTheNextPack, (cfg, str(signal)), name="pipelined")
    try:
        sync = WeightSync(lambda r: TRANSPORTS.get("distributed")(r), [engine], progress=None, bucket_bytes=1 << 15,
                          timeouts=SyncTimeouts(connect=60, call=30, bucket=60, verify=60))

        def pack(buffer, layout, tensors, views=None, checksum=None):
            out = pack_bucket(buffer, layout, tensors, views, checksum)
            if layout.index == 1:
                signal.touch()
            return out

        sync.pack = pack
        report = sync.sync(StateDictSource(list(trainer_model.named_parameters())))
        assert report.version == 1 == engine.weight_version and report.buckets > 2
        sync.close()
    finally:
        engine.shutdown(timeout=5)
