"""Adapter-only syncs into the embedded engine through the one orchestrator: the trainer's own export source
gives bit-identical merged weights and the trainer's logprobs; a corrupted bucket or a scale the engine's LoRA
config does not have is refused with the weights, the version and serving unchanged."""

import pytest
import torch

from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import ADAPTER, adapter_payload
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.weights import WeightSyncError
from beamrl.rollout.native.engine import NativeEngine
from beamrl.sync.export import StateDictSource
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
from beamrl.sync.plan import plan_buckets
from beamrl.sync.transports import TRANSPORTS

from ...sync.faults import FlippedBit
from ...trainer.megatron import _lora_equivalence as L

pytestmark = pytest.mark.slow
LOGPROB_TOL = 1e-5
BUCKET_BYTES = 4096


@pytest.fixture(scope="module")
def trained():
    return L.trained_adapter_once()


def make_engine(trained, lora=None) -> NativeEngine:
    model = BeamForCausalLM(trained["config"], dtype=torch.float32, seed=None)
    model.load_hf_tensors(trained["base"], strict=True)
    return NativeEngine.from_model(model, lora=lora or trained["lora"])


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def sync(engine, source, transport=lambda r: TRANSPORTS.get("colocated")(r)):
    ws = WeightSync(transport, [engine], bucket_bytes=BUCKET_BYTES, timeouts=SyncTimeouts.uniform(60),
                    initial_version=engine.served_weight_version(5), progress=None)
    try:
        return ws.sync(source)
    finally:
        ws.close()


def adapter_source(adapter, lora):
    return StateDictSource(adapter_payload(adapter, lora), mode=ADAPTER)


def test_trainer_adapter_sync_gives_the_trainers_merged_weights_and_logprobs(trained):
    native = trained["native"]  # LoRAExportSource -> WeightSync -> colocated -> NativeEngine, in the trainer rank
    report = native["report"]
    assert report["verified"] and report["version"] == 1 and native["adapters_applied"] == 1
    assert report["buckets"] > 2  # several buckets: the scale in the first, the merge at commit
    adapter_bytes = sum(v.numel() * v.element_size() for v in trained["adapter"].values())
    assert report["bytes"] == adapter_bytes + 4  # only the adapter tensors and the scale travel
    state = native["weights"]
    assert state.keys() == trained["merged"].keys()
    differing = [n for n, w in trained["merged"].items() if not torch.equal(state[n], w)]
    assert not differing, f"engine weights differ from the trainer's merged weights: {differing[:3]}"
    moved = [n for n in trained["merged"] if not torch.equal(trained["merged"][n], trained["base"][n])]
    assert len(moved) > 50  # the adapter changes every targeted weight
    assert max_diff(native["logprobs"], trained["logprobs"]) <= LOGPROB_TOL
    assert report["max_abs_logprob_diff"] <= LOGPROB_TOL


def test_corrupted_or_foreign_adapter_is_refused_and_changes_nothing(trained):
    engine = make_engine(trained)
    sync(engine, adapter_source(trained["adapter"], trained["lora"]))
    assert engine.weight_version == 1 and engine.adapters_applied == 1
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = engine.score(L.PROBES, 60)
    other = adapter_source({k: v * 1.5 for k, v in trained["adapter"].items()}, trained["lora"])
    last = len(plan_buckets(other.units(), BUCKET_BYTES).buckets) - 1
    for bad in (1, last):  # the last bucket's refusal surfaces while the session commits
        with pytest.raises(WeightSyncError, match=f"bucket {bad} failed its checksum"):
            sync(engine, other, lambda r, bad=bad: FlippedBit(r, bad=bad))
    lora = trained["lora"]
    foreign = LoRAConfig(**{**lora.to_dict(), "alpha": lora.alpha * 2})  # the trainer's trainer.lora differs
    with pytest.raises(WeightSyncError, match="scale"):
        sync(engine, adapter_source(trained["adapter"], foreign))
    assert engine.weight_version == 1 and engine.adapters_applied == 1
    assert all(torch.equal(v, state[k]) for k, v in engine.model.state_dict().items())
    assert engine.health(5) and engine.score(L.PROBES, 60) == before  # still serving, the same weights
    report = sync(engine, other)  # a good sync still works
    assert report.version == 2 and engine.adapters_applied == 2


def test_base_update_under_an_adapter_merges_it_again(trained):
    engine = make_engine(trained)
    sync(engine, adapter_source(trained["adapter"], trained["lora"]))
    sync(engine, StateDictSource(list(trained["base"].items())))  # a full sync of the same base
    state = engine.model.state_dict()
    assert all(torch.equal(state[n], w) for n, w in trained["merged"].items())
