"""The seam for adapter-only syncs: another export source (another set of named tensors, `mode="adapter"`) goes
through the same orchestrator, manifest, checksums and commit, and the receiver applies it through the target it
registered for that mode (what LoRA plugs in: stage the adapter, merge at commit, drop it on abort)."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import StateDictSource
from beamrl.sync.local_receiver import ApplyTarget, LocalWeightReceiver
from beamrl.sync.orchestrator import WeightSync
from beamrl.sync.transports import TRANSPORTS

from .faults import FlippedBit

ADAPTER = {f"model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": shape
           for i in range(2) for ab, shape in (("A", (4, 64)), ("B", (64, 4)))}


class StagedAdapter(ApplyTarget):
    """An adapter target: tensors land in staging buffers; `commit` is where a LoRA target would merge them."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.committed: dict[str, torch.Tensor] | None = None
        self.discarded = 0

    def table(self):
        return {n: (shape, torch.float32) for n, shape in ADAPTER.items()}

    def destinations(self, metas):
        out = []
        for m in metas:
            self.buffers[m.name] = torch.empty(m.shape, dtype=m.dtype)
            out.append(self.buffers[m.name])
        return out

    def commit(self):
        self.committed, self.buffers = dict(self.buffers), {}

    def discard(self):
        self.buffers, self.discarded = {}, self.discarded + 1


def adapter_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(shape, generator=g)) for n, shape in ADAPTER.items()]


def _sync(receiver, named, make=None):
    sync = WeightSync(make or (lambda r: TRANSPORTS.get("colocated")(r)), [receiver], bucket_bytes=2048,
                      initial_version=receiver.weight_version, progress=None)
    try:
        return sync.sync(StateDictSource(named, mode="adapter", unit_size=1))
    finally:
        sync.close()


def test_an_adapter_source_goes_through_the_same_session_into_its_target():
    model = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    target = StagedAdapter()
    receiver = LocalWeightReceiver(model, name="eng", targets={"adapter": target})
    named = adapter_tensors(1)
    report = _sync(receiver, named)
    assert report.version == 1 == receiver.weight_version and report.buckets > 1
    assert set(target.committed) == set(ADAPTER)
    assert all(torch.equal(target.committed[n], t) for n, t in named)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the base weights untouched


def test_adapter_faults_are_refused_like_any_other():
    model = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0)
    plain = LocalWeightReceiver(model, name="plain")
    with pytest.raises(WeightSyncError, match="unknown apply mode 'adapter'"):
        _sync(plain, adapter_tensors(1))
    target = StagedAdapter()
    receiver = LocalWeightReceiver(model, name="eng", targets={"adapter": target})
    wrong = [(n.replace("q_proj", "o_proj"), t) for n, t in adapter_tensors(2)]
    with pytest.raises(WeightSyncError, match="does not have: 'model.layers.0.self_attn.o_proj.lora_A.weight'"):
        _sync(receiver, wrong)
    with pytest.raises(WeightSyncError, match="bucket 1 failed its checksum"):
        _sync(receiver, adapter_tensors(3), make=lambda r: FlippedBit(r, bad=1))
    assert target.committed is None and target.discarded == 1 and receiver.weight_version == 0
