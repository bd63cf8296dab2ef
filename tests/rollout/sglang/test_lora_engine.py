"""The real SGLang 0.5.23 CPU engine with beamrl's out-of-tree Beam class (one engine start): it applies the
trainer's adapter with bit-identical effective weights and the trainer's logprobs, and refuses a corrupted
adapter with its reason, leaving the weights and the version unchanged."""

import pytest
import torch

from beamrl.models.beam.lora import adapted_weights
from beamrl.models.beam.lora_payload import build_adapter_payload
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.sync.protocol import WeightSyncError

from ...trainer.megatron import _lora_equivalence as L

pytestmark = pytest.mark.slow
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("sglang")
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    trained = L.trained_adapter_once()
    torch.set_num_threads(1)
    model = BeamForCausalLM(trained["config"], dtype=torch.float32, seed=None)
    model.load_hf_tensors(trained["base"], strict=True)
    ckpt = tmp_path_factory.mktemp("sgl-lora-ckpt")
    model.save_pretrained(ckpt)
    engine = SGLangEngine(SGLangEngineConfig.cpu_test(str(ckpt), dtype="float32", enable_fp32_lm_head=True,
                                                      enable_return_routed_experts=False,
                                                      lora_targets=tuple(trained["lora"].targets)),
                          start_timeout=600)
    yield engine, trained
    engine.shutdown()


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def adapted_names(trained):
    return [w.weight for w in adapted_weights(trained["config"], trained["lora"])]


def test_sglang_applies_the_trainers_adapter_bit_for_bit(setup):
    engine, trained = setup
    status = engine.lora_status(60)
    assert status["lora_class"] and status["adapter_id"] is None
    before = engine.score(L.PROBES, 60)
    engine.apply_lora_adapter(build_adapter_payload(trained["adapter"], trained["lora"], "step-1"), 1, 120)
    assert engine.weight_version == 1 and engine.lora_status(60)["adapter_id"] == "step-1"
    names = adapted_names(trained) + ["model.layers.0.input_layernorm.weight"]
    differing = [n for n in names if not torch.equal(engine.lora_effective_weight(n, 60), trained["merged"][n])]
    assert not differing, f"SGLang's effective weights differ from the trainer's merged weights: {differing[:3]}"
    after = engine.score(L.PROBES, 60)
    assert max_diff(before, trained["logprobs"]) > 100 * LOGPROB_TOL  # the adapter is visible
    assert max_diff(after, trained["logprobs"]) <= LOGPROB_TOL


def test_sglang_refuses_a_corrupted_adapter(setup):
    engine, trained = setup
    if engine.lora_status(60)["adapter_id"] != "step-1":
        engine.apply_lora_adapter(build_adapter_payload(trained["adapter"], trained["lora"], "step-1"), 1, 120)
    version = engine.weight_version
    probe = adapted_names(trained)[::17]
    weights = {n: engine.lora_effective_weight(n, 60) for n in probe}
    payload = build_adapter_payload({k: v * 1.5 for k, v in trained["adapter"].items()}, trained["lora"], "step-2")
    name, t = payload[5]
    corrupt = t.clone()
    corrupt.view(-1).view(torch.uint8)[1] ^= 0x01
    payload[5] = (name, corrupt)
    with pytest.raises(WeightSyncError, match="SHA-256") as err:
        engine.apply_lora_adapter(payload, version + 1, 120)
    assert name in str(err.value)
    assert engine.weight_version == version and engine.lora_status(60)["adapter_id"] == "step-1"
    assert all(torch.equal(engine.lora_effective_weight(n, 60), w) for n, w in weights.items())
    assert engine.health(30)
