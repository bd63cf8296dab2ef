"""The real SGLang 0.5.23 CPU engine with beamrl's out-of-tree Beam class (one engine start), synced through the
one orchestrator: an adapter-only sync gives bit-identical effective weights and the trainer's logprobs; a
corrupted bucket (before or while the adapter completes) or a scale the engine's LoRA config does not have is
refused with its reason, leaving the weights and the version unchanged; a session aborted after its adapter was
merged is rolled back to the committed adapter."""

import pytest
import torch

from beamrl.models.beam.lora import adapted_weights
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import ADAPTER, adapter_payload
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import StateDictSource
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
from beamrl.sync.plan import plan_buckets
from beamrl.sync.transports import TRANSPORTS

from ...sync.faults import FlippedBit
from ...trainer.megatron import _lora_equivalence as L

pytestmark = pytest.mark.slow
LOGPROB_TOL = 1e-5
BUCKET_BYTES = 8192


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    trained = L.trained_adapter_once()
    torch.set_num_threads(1)
    model = BeamForCausalLM(trained["config"], dtype=torch.float32, seed=None)
    model.load_hf_tensors(trained["base"], strict=True)
    ckpt = tmp_path_factory.mktemp("sgl-lora-ckpt")
    model.save_pretrained(ckpt)
    engine = SGLangEngine(SGLangEngineConfig.on_cpu(str(ckpt), dtype="float32", enable_fp32_lm_head=True,
                                                    return_routed_experts=False, lora=trained["lora"]),
                          start_timeout=600)
    yield engine, trained
    engine.shutdown()


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def adapted_names(trained):
    return [w.weight for w in adapted_weights(trained["config"], trained["lora"])]


def sync(engine, source, transport=lambda r: TRANSPORTS.get("colocated")(r)):
    ws = WeightSync(transport, [engine], bucket_bytes=BUCKET_BYTES, timeouts=SyncTimeouts.uniform(120),
                    initial_version=engine.served_weight_version(5), progress=None)
    try:
        return ws.sync(source)
    finally:
        ws.close()


def adapter_source(adapter, lora):
    return StateDictSource(adapter_payload(adapter, lora), mode=ADAPTER)


def test_sglang_applies_the_trainers_adapter_bit_for_bit(setup):
    engine, trained = setup
    status = engine.lora_status(60)
    assert status["lora_class"] and status["applied"] == 0
    before = engine.score(L.PROBES, 60)
    report = sync(engine, adapter_source(trained["adapter"], trained["lora"]))
    assert report.buckets > 2 and engine.weight_version == 1 and engine.lora_status(60)["applied"] == 1
    names = adapted_names(trained) + ["model.layers.0.input_layernorm.weight"]
    differing = [n for n in names if not torch.equal(engine.lora_effective_weight(n, 60), trained["merged"][n])]
    assert not differing, f"SGLang's effective weights differ from the trainer's merged weights: {differing[:3]}"
    after = engine.score(L.PROBES, 60)
    assert max_diff(before, trained["logprobs"]) > 100 * LOGPROB_TOL  # the adapter is visible
    assert max_diff(after, trained["logprobs"]) <= LOGPROB_TOL


def test_sglang_refuses_a_corrupted_or_foreign_adapter(setup):
    engine, trained = setup
    if engine.lora_status(60)["applied"] == 0:
        sync(engine, adapter_source(trained["adapter"], trained["lora"]))
    version, applied = engine.weight_version, engine.lora_status(60)["applied"]
    probe = adapted_names(trained)[::17]
    weights = {n: engine.lora_effective_weight(n, 60) for n in probe}
    other = adapter_source({k: v * 1.5 for k, v in trained["adapter"].items()}, trained["lora"])
    last = len(plan_buckets(other.units(), BUCKET_BYTES).buckets) - 1
    for bad in (1, last):  # refused by the engine adapter's checksum before SGLang sees the bucket
        with pytest.raises(WeightSyncError, match=f"bucket {bad} failed its checksum"):
            sync(engine, other, lambda r, bad=bad: FlippedBit(r, bad=bad))
    lora = trained["lora"]
    foreign = LoRAConfig(**{**lora.to_dict(), "alpha": lora.alpha * 2})
    with pytest.raises(WeightSyncError, match="scale"):  # refused inside beamrl's model class, reported at commit
        sync(engine, adapter_source(trained["adapter"], foreign))
    assert engine.weight_version == version and engine.lora_status(60)["applied"] == applied
    assert all(torch.equal(engine.lora_effective_weight(n, 60), w) for n, w in weights.items())
    # Every bucket arrived (the class merged the new adapter), then the trainer ranks disagree and the session is
    # aborted: the engine adapter re-sends the committed adapter, which merges back to the same weights.
    with pytest.raises(WeightSyncError):
        sync(engine, Disagrees(other.named, mode=ADAPTER))
    assert engine.weight_version == version and engine.lora_status(60)["applied"] == applied + 2
    assert all(torch.equal(engine.lora_effective_weight(n, 60), w) for n, w in weights.items())
    assert engine.health(30)


class Disagrees(StateDictSource):
    """An export whose trainer ranks report a failure after every unit was shipped (the session is aborted)."""

    def finish(self, ok: bool) -> bool:
        return False
