"""The one bucketing pass (`plan_buckets` + `assemble`) and the one packing function (`pack_bucket`): fused groups
whole, sizes bounded, dtypes kept, buckets complete in order whatever the export order, the stream checked against
the layout, and packed bytes identical to SGLang's flattened layout."""

import random

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import random_state_dict
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import specs_of
from beamrl.sync.packing import pack_bucket, pack_session
from beamrl.sync.plan import beam_atomic_group, plan_buckets


@pytest.fixture(scope="module")
def state_dict():
    sd = random_state_dict(preset("tiny"), seed=0)
    sd["model.norm.weight"] = sd["model.norm.weight"].bfloat16()  # mixed dtypes: bf16 next to the fp32 router
    return sd


def shuffled_units(sd, seed, unit=7):
    """An exporter that yields group members far apart and in odd order (e.g. TP/EP gather order)."""
    items = list(sd.items())
    random.Random(seed).shuffle(items)
    return [items[i:i + unit] for i in range(0, len(items), unit)]


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
def test_groups_whole_sizes_bounded_dtypes_kept_in_order(state_dict, bucket_bytes):
    units = shuffled_units(state_dict, seed=bucket_bytes)
    plan = plan_buckets([specs_of(u) for u in units], bucket_bytes)
    where = {m.name: b.index for b in plan.buckets for m in b.metas}
    assert sorted(where) == sorted(state_dict)  # every tensor exactly once
    groups = expected_groups(state_dict)
    assert len(groups) > 20
    for members in groups.values():
        assert len({where[n] for n in members}) == 1, members
    for b in plan.buckets:
        if b.nbytes > bucket_bytes:  # only a single oversized unit may exceed the bound
            units_in = {next((k for k, m in groups.items() if n in m), n) for n in b.names}
            assert len(units_in) == 1, (b.nbytes, b.names)
        sizes = [m.dtype.itemsize for m in b.metas]
        assert sizes == sorted(sizes, reverse=True)  # wider dtypes first: every offset aligned
    got = list(plan.assemble(units))
    assert [k for k, _ in got] == list(range(len(plan.buckets)))  # complete in index order
    for k, tensors in got:
        for m, t in zip(plan.buckets[k].metas, tensors):
            assert t is state_dict[m.name]  # no copies, no dtype change
    assert (len(plan.buckets) == 1) == (bucket_bytes == 10 ** 9)
    assert plan.nbytes == sum(t.numel() * t.element_size() for t in state_dict.values())


def test_packed_bytes_equal_the_flattened_bucket_layout(state_dict):
    manifest, buckets = pack_session(list(state_dict.items()), version=3, bucket_bytes=20_000)
    assert manifest.version == 3 and len(buckets) == len(manifest.buckets) > 3
    for b, layout in zip(buckets, manifest.buckets):
        ref = FlatBucket.from_named_tensors([(m.name, state_dict[m.name]) for m in layout.metas])
        assert torch.equal(b.buffer, ref.buffer) and b.metas == ref.metas
        for name, t in b.unflatten():
            assert t.dtype == state_dict[name].dtype and torch.equal(t, state_dict[name])
    # the same layout gives the same digest whatever the version; another layout another digest
    again, _ = pack_session(list(state_dict.items()), version=9, bucket_bytes=20_000)
    other, _ = pack_session(list(state_dict.items()), version=3, bucket_bytes=40_000)
    assert again.digest == manifest.digest != other.digest


def test_pack_bucket_uses_cached_views_of_its_buffer(state_dict):
    plan = plan_buckets([specs_of(list(state_dict.items()))], 10 ** 9)
    (k, tensors), = plan.assemble([list(state_dict.items())])
    layout = plan.buckets[k]
    buf = torch.full((layout.nbytes + 64,), 255, dtype=torch.uint8)
    out = pack_bucket(buf, layout, tensors)
    assert out.numel() == layout.nbytes and torch.all(buf[layout.nbytes:] == 255)
    for m, t in zip(layout.metas, tensors):
        assert torch.equal(buf[m.start:m.end].view(m.dtype).view(m.shape), t)


def test_assemble_checks_the_stream_against_the_layout(state_dict):
    items = list(state_dict.items())
    plan = plan_buckets([specs_of(items)], 40_000)
    with pytest.raises(WeightSyncError, match=f"yielded {items[-1][0]!r} where its layout has {items[0][0]!r}"):
        list(plan.assemble([[items[-1]] + items[:-1]]))
    name, t = items[3]
    with pytest.raises(WeightSyncError, match=f"yielded {name!r} as torch.float64"):
        list(plan.assemble([items[:3] + [(name, t.double())] + items[4:]]))
    with pytest.raises(WeightSyncError, match="export ended after 10 of the"):
        list(plan.assemble([items[:10]]))


def test_oversized_tensor_gets_its_own_bucket():
    named = [("a", torch.zeros(10)), ("big", torch.zeros(1000)), ("b", torch.zeros(10))]
    plan = plan_buckets([specs_of(named)], bucket_bytes=100)
    assert [b.names for b in plan.buckets] == [["a"], ["big"], ["b"]]


def test_atomic_group_rule_names():
    assert beam_atomic_group("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_gate"
    expert = "model.layers.3.mlp.experts.7."
    assert beam_atomic_group(expert + "up_proj.weight") == expert + "gate_up"
    assert beam_atomic_group("model.layers.3.mlp.experts.7.down_proj.weight") is None
    assert beam_atomic_group("model.layers.3.self_attn.o_proj.weight") is None


def test_empty_and_duplicate_exports_are_loud():
    with pytest.raises(WeightSyncError, match="zero tensors"):
        plan_buckets([])
    with pytest.raises(WeightSyncError, match="zero tensors"):
        plan_buckets([[], []])
    with pytest.raises(WeightSyncError, match="twice"):
        plan_buckets([specs_of([("x", torch.zeros(1))]), specs_of([("x", torch.zeros(1))])])


def test_pack_bucket_copies_large_tensors_one_by_one_and_the_rest_batched(state_dict, monkeypatch):
    from beamrl.sync import packing

    plan = plan_buckets([specs_of(list(state_dict.items()))], 10 ** 9)
    (k, tensors), = plan.assemble([list(state_dict.items())])
    layout = plan.buckets[k]
    sizes = sorted(t.numel() * t.element_size() for t in tensors)
    monkeypatch.setattr(packing, "LARGE_COPY_BYTES", sizes[len(sizes) // 2])  # both paths in one bucket
    calls = {"one": 0, "batched": 0}
    foreach = torch._foreach_copy_

    def batched(dst, src, **kw):
        calls["batched"] += 1
        assert all(d.numel() * d.element_size() < packing.LARGE_COPY_BYTES for d in dst)
        return foreach(dst, src, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", batched)
    buf = torch.full((layout.nbytes,), 255, dtype=torch.uint8)
    pack_bucket(buf, layout, tensors)
    assert calls["batched"] == 1
    for m, t in zip(layout.metas, tensors):  # every tensor, large or small, landed at its bytes
        assert torch.equal(buf[m.start:m.end].view(m.dtype).view(m.shape), t)


def test_copy_tensors_copies_large_tensors_as_bytes_and_strided_ones_as_they_are(monkeypatch):
    from beamrl.sync import packing

    monkeypatch.setattr(packing, "LARGE_COPY_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(8, 6, generator=g).bfloat16(), torch.randn(6, 8, generator=g).t(), torch.randn(8, 6, generator=g),
           torch.randn(3, generator=g)]
    # a strided source, then a strided destination (a flat byte view of it would be a copy: the write would be lost)
    dst = [torch.zeros(8, 6, dtype=torch.bfloat16), torch.zeros(8, 6), torch.zeros(6, 8).t(), torch.zeros(3)]
    packing.copy_tensors(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)


def _when_yielded(units, buckets_of):
    """(bucket, units pulled from the stream when it was yielded) for each bucket `buckets_of(stream)` yields."""
    pulled = [0]

    def stream():
        for u in units:
            pulled[0] += 1
            yield u

    return [(k if isinstance(k, int) else k[0], pulled[0]) for k in buckets_of(stream())]


@pytest.mark.parametrize("seed", [0, 1])
def test_completions_follow_assemble_from_the_unit_sizes_alone(state_dict, seed):
    """A rank without tensors (empty units) sees each bucket complete after the same unit as the shipping rank,
    and the shipping rank can resume following them after `assemble` stopped mid-stream."""
    units = shuffled_units(state_dict, seed)
    plan = plan_buckets([specs_of(u) for u in units], bucket_bytes=64 * 1024)
    assert plan.arrived == tuple(sum(len(u) for u in units[:j]) for j in range(len(units) + 1))
    shipped = _when_yielded(units, plan.assemble)
    assert len(shipped) == len(plan.buckets) > 4
    assert _when_yielded([[] for _ in units], lambda s: plan.completions(s)) == shipped
    # resume after unit j with the buckets already seen: the rest, at the same points
    j = len(units) // 2
    seen = sum(1 for _, at in shipped if at < j)  # assemble stopped inside unit j: its buckets are still due
    rest = _when_yielded(units[j:], lambda s: plan.completions(s, units_done=j, next_bucket=seen))
    assert [(k, at + j) for k, at in rest] == shipped[seen:]
    with pytest.raises(WeightSyncError, match="incomplete"):
        list(plan.completions(iter([[]] * (len(units) - 1))))


def test_the_plans_manifest_is_built_once_per_mode_and_carries_each_syncs_version(state_dict):
    """The layout digest is computed once per apply mode (a 501B layout hashes ~38K tensors); every sync's manifest
    equals a freshly built one, with its own version."""
    from beamrl.protocols.manifest import SyncManifest

    plan = plan_buckets([specs_of(list(state_dict.items()))], 40_000)
    for version in (1, 2, 7):
        for mode in ("full", "adapter"):
            got = plan.manifest(version, mode)
            assert got == SyncManifest.build(version, mode, plan.buckets) and got.version == version
    assert plan.manifest(3, "full").digest != plan.manifest(3, "adapter").digest
    assert plan.manifest(3, "full").buckets is plan.manifest(4, "full").buckets  # built once, not per sync
