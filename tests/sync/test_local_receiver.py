"""The in-process receiver's exact verification (the native engine's receiver): the manifest is refused at begin for
a stale version, an unknown or missing tensor, a wrong shape or dtype or mode; a bucket out of order, laid out
otherwise than announced, or with a flipped bit is refused; and after any failure the weights are bit for bit the
previous ones (undo log) or the receiver stops serving (no undo log). Deferred (GPU-style) checks are settled at
commit."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.flat_bucket import FlatBucket, TensorMeta
from beamrl.protocols.manifest import SyncManifest
from beamrl.protocols.weights import ROLLED_BACK, UNHEALTHY, UNTOUCHED, WeightSyncError
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.packing import pack_session

T = 30.0


def _model(seed):
    return BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=seed).eval()


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(model, snap):
    return all(torch.equal(p, snap[n]) for n, p in model.named_parameters())


@pytest.fixture
def engine_model():
    torch.set_num_threads(1)
    return _model(0)


@pytest.fixture(scope="module")
def new_weights():
    return [(n, p.detach().clone()) for n, p in _model(1).named_parameters()]


def _session(named, version, bucket_bytes=1 << 15):
    return pack_session(named, version, bucket_bytes)


def _flip_bit(bucket: FlatBucket, byte: int = 100) -> FlatBucket:
    buf = bucket.buffer.clone()
    buf[byte] ^= 0x10
    return FlatBucket(buf, bucket.metas, index=bucket.index, checksum=bucket.checksum)


def _send_all(r: LocalWeightReceiver, weights, version: int) -> None:
    """Open a full session for `version` and send every bucket of `weights` (no commit)."""
    manifest, buckets = _session(weights, version)
    r.begin_weight_update(manifest, T)
    for b in buckets:
        r.update_weights_from_tensor(b, T)


def test_a_full_session_replaces_every_weight_and_bumps_the_version(engine_model, new_weights):
    r = LocalWeightReceiver(engine_model, name="eng", initial_version=4)
    _send_all(r, new_weights, 5)
    r.end_weight_update(5, T)
    assert r.weight_version == 5 and _same(engine_model, dict(new_weights)) and r.failure is None


def test_a_commit_for_another_version_than_the_sessions_is_refused(engine_model, new_weights):
    """end_weight_update must name the version of the session's manifest; another is refused, the old version kept."""
    r = LocalWeightReceiver(engine_model, name="eng", initial_version=0)
    _send_all(r, new_weights, 1)
    with pytest.raises(WeightSyncError, match=r"end_weight_update\(2\) but the session's manifest is for version 1"):
        r.end_weight_update(2, T)
    assert r.weight_version == 0 and not r.in_session


@pytest.mark.parametrize("fault, message", [
    ("stale", r"eng: refusing a stale weight version: the session would serve version 4 but the engine already "
              r"serves 4"),
    ("unknown", r"does not have: 'model.layers.0.self_attn.qq_proj.weight'"),
    ("missing", r"must send every tensor; missing 1: 'model.layers.1.mlp.experts.3.down_proj.weight'"),
    ("shape", r"tensor 'model.norm.weight' is announced as float32 \(3,\), the engine holds float32 \(64,\)"),
    ("dtype", r"tensor 'lm_head.weight' is announced as bfloat16 .* the engine holds float32"),
    ("mode", r"unknown apply mode 'adapter'"),
])
def test_manifest_faults_are_refused_at_begin_and_change_nothing(engine_model, new_weights, fault, message):
    r = LocalWeightReceiver(engine_model, name="eng", initial_version=4)
    named = dict(new_weights)
    version, mode = 5, "full"
    if fault == "stale":
        version = 4
    elif fault == "unknown":
        named["model.layers.0.self_attn.qq_proj.weight"] = named.pop("model.layers.0.self_attn.q_proj.weight")
    elif fault == "missing":
        del named["model.layers.1.mlp.experts.3.down_proj.weight"]
    elif fault == "shape":
        named["model.norm.weight"] = torch.zeros(3)
    elif fault == "dtype":
        named["lm_head.weight"] = named["lm_head.weight"].bfloat16()
    else:
        mode = "adapter"
    manifest, _ = pack_session(list(named.items()), version, 1 << 15, mode=mode)
    snap = _snapshot(engine_model)
    with pytest.raises(WeightSyncError, match=message):
        r.begin_weight_update(manifest, T)
    assert _same(engine_model, snap) and r.weight_version == 4 and not r.in_session and r.failure is None


def test_bucket_order_and_layout_are_checked(engine_model, new_weights):
    r = LocalWeightReceiver(engine_model, name="eng")
    manifest, buckets = _session(new_weights, 1)
    r.begin_weight_update(manifest, T)
    with pytest.raises(WeightSyncError, match="bucket 1 arrived, expected bucket 0 of"):
        r.update_weights_from_tensor(buckets[1], T)
    assert r.abort_weight_update("test", T) == UNTOUCHED
    # a tensor sent under another name than the manifest announced (same bytes, same checksum)
    b0 = buckets[0]
    m = b0.metas[0]
    renamed = [TensorMeta("model.layers.5.self_attn.q_norm.weight", m.shape, m.dtype, m.start, m.end)] + b0.metas[1:]
    r.begin_weight_update(manifest, T)
    with pytest.raises(WeightSyncError, match=r"bucket 0, tensor 0: arrived as 'model.layers.5.self_attn.q_norm.weight'"):
        r.update_weights_from_tensor(FlatBucket(b0.buffer, renamed, index=0, checksum=b0.checksum), T)
    with pytest.raises(WeightSyncError, match="this session already failed"):
        r.update_weights_from_tensor(buckets[1], T)  # a failed session takes no more buckets
    assert r.abort_weight_update("test", T) == UNTOUCHED and r.failure is None


@pytest.mark.parametrize("defer", [False, True], ids=["checked-before-apply", "deferred-to-commit"])
def test_a_flipped_bit_after_good_buckets_is_rolled_back_bit_for_bit(engine_model, new_weights, defer):
    r = LocalWeightReceiver(engine_model, name="eng", initial_version=2, rollback=True, defer_checks=defer)
    snap = _snapshot(engine_model)
    manifest, buckets = _session(new_weights, 3)
    bad = len(buckets) // 2
    r.begin_weight_update(manifest, T)
    for i, b in enumerate(buckets):
        if i == bad:
            b = _flip_bit(b)
            if not defer:
                with pytest.raises(WeightSyncError, match=f"eng: bucket {bad} failed its checksum"):
                    r.update_weights_from_tensor(b, T)
                break
        r.update_weights_from_tensor(b, T)
    if defer:  # every bucket was loaded; the mismatch surfaces at commit, which rolls back
        with pytest.raises(WeightSyncError, match=rf"without serving version 3 \(rolled back\).*\[{bad}\] failed"):
            r.end_weight_update(3, T)
    else:
        assert r.abort_weight_update("bucket refused", T) == ROLLED_BACK
    assert _same(engine_model, snap) and r.weight_version == 2 and r.failure is None and not r.in_session


def test_without_an_undo_log_a_failed_session_stops_serving_until_reloaded(engine_model, new_weights, tmp_path):
    r = LocalWeightReceiver(engine_model, name="eng", rollback=False, defer_checks=True)
    manifest, buckets = _session(new_weights, 1)
    r.begin_weight_update(manifest, T)
    r.update_weights_from_tensor(buckets[0], T)
    with pytest.raises(WeightSyncError, match=rf"\({UNHEALTHY}\): eng: commit after 1 of \d+ buckets"):
        r.end_weight_update(1, T)  # an incomplete session is never committed
    assert r.weight_version == 0 and "partly updated" in r.failure
    # a session that failed before touching anything leaves it as it was
    r2 = LocalWeightReceiver(_model(2), name="eng2", rollback=False)
    r2.begin_weight_update(manifest, T)
    with pytest.raises(WeightSyncError, match="failed its checksum"):
        r2.update_weights_from_tensor(_flip_bit(buckets[0]), T)
    assert r2.abort_weight_update("refused", T) == UNTOUCHED and r2.failure is None
    # reloading every weight from a checkpoint serves again
    _model(7).save_pretrained(tmp_path)
    r.update_weights_from_disk(str(tmp_path), T)
    assert r.failure is None and _same(engine_model, _snapshot(_model(7)))


def test_manifest_digest_names_the_layout_not_the_version(new_weights):
    a, _ = _session(new_weights, 1)
    b, _ = _session(new_weights, 2)
    assert a.digest == b.digest and a.with_version(7).digest == a.digest
    assert SyncManifest.build(1, "full", a.buckets[:-1]).digest != a.digest
