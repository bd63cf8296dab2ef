"""Bucketing keeps SGLang's fused groups whole, bounds bucket size, preserves dtypes and refuses empty exports."""

import random

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import random_state_dict
from beamrl.sync.bucketing import beam_atomic_group, bucketize
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.weights import WeightSyncError


@pytest.fixture(scope="module")
def state_dict():
    return random_state_dict(preset("tiny"), seed=0)


def shuffled_chunks(sd, seed, chunk=7):
    """An exporter that yields group members far apart and in odd order (e.g. TP/EP gather order)."""
    items = list(sd.items())
    random.Random(seed).shuffle(items)
    return [items[i:i + chunk] for i in range(0, len(items), chunk)]


def expected_groups(sd):
    """Fused groups derived from the HF names independently of the code under test."""
    groups: dict[str, set[str]] = {}
    for name in sd:
        parts = name.split(".")
        if parts[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj") and parts[-3] == "self_attn":
            groups.setdefault(".".join(parts[:-2]) + "#attn", set()).add(name)
        elif parts[-2] in ("gate_proj", "up_proj") and "mlp" in parts:
            groups.setdefault(".".join(parts[:-2]) + "#mlp", set()).add(name)
        elif name.endswith("mlp.gate.weight") or name.endswith("mlp.gate.e_score_correction_bias"):
            groups.setdefault(".".join(parts[:-1]) + "#router", set()).add(name)
    return groups


@pytest.mark.parametrize("bucket_bytes", [3000, 40_000, 10 ** 9])
def test_groups_whole_sizes_bounded_dtypes_kept(state_dict, bucket_bytes):
    buckets = list(bucketize(shuffled_chunks(state_dict, seed=bucket_bytes), bucket_bytes=bucket_bytes))
    where = {n: i for i, b in enumerate(buckets) for n in b.names}
    assert sorted(where) == sorted(state_dict)  # every tensor exactly once
    assert sum(len(b.names) for b in buckets) == len(state_dict)
    groups = expected_groups(state_dict)
    assert len(groups) > 20
    for members in groups.values():
        assert len({where[n] for n in members}) == 1, members
    for b in buckets:
        if b.nbytes > bucket_bytes:  # only a single oversized unit may exceed the bound
            units = {next((k for k, m in groups.items() if n in m), n) for n in b.names}
            assert len(units) == 1, (b.nbytes, b.names)
        for n, t in zip(b.names, b.tensors):
            assert t.dtype == state_dict[n].dtype and torch.equal(t, state_dict[n])
        FlatBucket.from_named_tensors(list(zip(b.names, b.tensors)))  # aligned: the flat layout accepts it
    if bucket_bytes == 10 ** 9:
        assert len(buckets) == 1
    else:
        assert len(buckets) > 3


def test_router_stays_fp32(state_dict):
    buckets = list(bucketize([list(state_dict.items())], bucket_bytes=10_000))
    routers = [(n, t) for b in buckets for n, t in zip(b.names, b.tensors) if ".mlp.gate." in n]
    assert routers and all(t.dtype == torch.float32 for _, t in routers)


def test_oversized_tensor_gets_its_own_bucket():
    big = torch.zeros(1000)  # 4000 bytes > bucket
    buckets = list(bucketize([[("a", torch.zeros(10)), ("big", big), ("b", torch.zeros(10))]], bucket_bytes=100))
    assert [b.names for b in buckets] == [["a"], ["big"], ["b"]]


def test_atomic_group_rule_names():
    assert beam_atomic_group("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_gate", 4)
    expert = "model.layers.3.mlp.experts.7."
    assert beam_atomic_group(expert + "up_proj.weight") == (expert + "gate_up", 2)
    assert beam_atomic_group("model.layers.3.mlp.experts.7.down_proj.weight") is None
    assert beam_atomic_group("model.layers.3.self_attn.o_proj.weight") is None


def test_empty_export_is_loud():
    with pytest.raises(WeightSyncError, match="zero tensors"):
        list(bucketize([]))
    with pytest.raises(WeightSyncError, match="zero tensors"):
        list(bucketize([[], []]))


def test_duplicate_and_incomplete_groups_are_loud(state_dict):
    with pytest.raises(WeightSyncError, match="twice"):
        list(bucketize([[("x", torch.zeros(1))], [("x", torch.zeros(1))]]))
    partial = [(n, t) for n, t in state_dict.items() if not n.endswith("self_attn.v_proj.weight")]
    with pytest.raises(WeightSyncError, match="incomplete fused groups: model.layers.0.self_attn.qkv_gate"):
        list(bucketize([partial]))
    # adapter-style partial updates may opt out
    assert sum(len(b.names) for b in bucketize([partial], require_complete_groups=False)) == len(partial)
