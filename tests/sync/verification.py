"""Verification scenarios run against every real engine (the embedded engine in its own process, the SGLang CPU
engine): a stale version, a missing tensor, an unknown name, a bucket with one flipped bit and a tensor sent under
another name each give a clear error, and the engine keeps its previous weights (its own checksum of every
parameter, bit for bit), its version, and serves."""

from __future__ import annotations

import pytest

from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import StateDictSource
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
from beamrl.sync.plan import plan_buckets
from beamrl.sync.transports import TRANSPORTS

from .faults import FlippedBit, Renamed

TIMEOUTS = SyncTimeouts.uniform(120)
PROBES = [[1, 5, 9, 200, 17, 3, 88, 41, 2, 9], [7, 7, 7, 300, 2, 511, 64]]


def engine_state(engine, timeout: float = 120):
    return engine.served_weight_version(timeout), engine.weights_checksum(timeout), engine.score(PROBES, timeout)


def _sync(engine, make, source, bucket_bytes, version=None):
    sync = WeightSync(make, [engine], bucket_bytes=bucket_bytes, timeouts=TIMEOUTS,
                      initial_version=engine.served_weight_version(60), progress=None)
    try:
        return sync.sync(source, version=version)
    finally:
        sync.close()


def manifest_faults(engine, named: list, bucket_bytes: int) -> None:
    """Refused at begin, before anything is applied."""
    before = engine_state(engine)
    colocated = lambda receivers: TRANSPORTS.get("colocated")(receivers)  # noqa: E731
    with pytest.raises(WeightSyncError, match="refusing a stale weight version"):
        _sync(engine, colocated, StateDictSource(named), bucket_bytes, version=before[0])
    missing = [(n, t) for n, t in named if n != "model.layers.1.mlp.experts.3.down_proj.weight"]
    with pytest.raises(WeightSyncError, match=r"must send every tensor; missing 1: "
                                              r"'model.layers.1.mlp.experts.3.down_proj.weight'"):
        _sync(engine, colocated, StateDictSource(missing), bucket_bytes)
    renamed = [(n.replace("self_attn.o_proj", "self_attn.out_proj"), t) for n, t in named]
    with pytest.raises(WeightSyncError, match=r"does not have: 'model.layers.0.self_attn.out_proj.weight'"):
        _sync(engine, colocated, StateDictSource(renamed), bucket_bytes)
    assert engine_state(engine) == before


def transit_faults(engine, named: list, bucket_bytes: int) -> None:
    """A flipped bit in bucket 2 (after two good ones) and in the last bucket (its refusal surfaces while the
    session commits), and a tensor sent under another name: refused before it is applied; the good buckets are
    rolled back."""
    before = engine_state(engine)
    with pytest.raises(WeightSyncError, match="bucket 2 failed its checksum"):
        _sync(engine, lambda r: FlippedBit(r, bad=2), StateDictSource(named), bucket_bytes)
    assert engine_state(engine) == before
    last = len(plan_buckets(StateDictSource(named).units(), bucket_bytes).buckets) - 1
    with pytest.raises(WeightSyncError, match=f"bucket {last} failed its checksum"):  # seen only while committing
        _sync(engine, lambda r: FlippedBit(r, bad=last), StateDictSource(named), bucket_bytes)
    assert engine_state(engine) == before
    with pytest.raises(WeightSyncError, match=r"bucket 2, tensor 0: arrived as 'model.norm.weight'"):
        _sync(engine, lambda r: Renamed(r, bad=2, to="model.norm.weight"), StateDictSource(named), bucket_bytes)
    assert engine_state(engine) == before
    report = _sync(engine, lambda r: TRANSPORTS.get("colocated")(r), StateDictSource(named), bucket_bytes)
    after = engine_state(engine)
    assert report.buckets > 2 and after[0] == before[0] + 1 and after[1] != before[1]  # a real sync still works
