"""The embedded engine applies the trainer's adapter: bit-identical merged weights, the trainer's logprobs, and a
corrupted payload is refused with the weights, the version and serving unchanged."""

import pytest
import torch

from beamrl.models.beam.lora_payload import build_adapter_payload
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.rollout.native.engine import NativeEngine
from beamrl.sync.protocol import WeightSyncError

from ...trainer.megatron import _lora_equivalence as L

pytestmark = pytest.mark.slow
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def trained():
    return L.trained_adapter_once()


def make_engine(trained) -> NativeEngine:
    model = BeamForCausalLM(trained["config"], dtype=torch.float32, seed=None)
    model.load_hf_tensors(trained["base"], strict=True)
    return NativeEngine.from_model(model)


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_engine_holds_the_trainers_merged_weights_and_logprobs(trained):
    engine = make_engine(trained)
    before = engine.score(L.PROBES, 60)
    engine.apply_lora_adapter(build_adapter_payload(trained["adapter"], trained["lora"], "step-1"), 1, 60)
    assert engine.weight_version == 1 and engine.lora_adapter_id == "step-1"
    state = engine.model.state_dict()
    assert state.keys() == trained["merged"].keys()
    differing = [n for n, w in trained["merged"].items() if not torch.equal(state[n], w)]
    assert not differing, f"engine weights differ from the trainer's merged weights: {differing[:3]}"
    moved = [n for n in trained["merged"] if not torch.equal(trained["merged"][n], trained["base"][n])]
    assert len(moved) > 50  # the adapter changes every targeted weight
    after = engine.score(L.PROBES, 60)
    assert max_diff(after, trained["logprobs"]) <= LOGPROB_TOL
    assert max_diff(before, trained["logprobs"]) > 100 * LOGPROB_TOL  # the adapter is visible in the logprobs


@pytest.mark.parametrize("what", ["tensor", "manifest"])
def test_corrupted_payload_is_refused_and_changes_nothing(trained, what):
    engine = make_engine(trained)
    engine.apply_lora_adapter(build_adapter_payload(trained["adapter"], trained["lora"], "step-1"), 1, 60)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = {k: v * 1.5 for k, v in trained["adapter"].items()}
    payload = build_adapter_payload(other, trained["lora"], "step-2")
    index = 7 if what == "tensor" else 0
    name, t = payload[index]
    corrupt = t.clone()
    corrupt.view(-1).view(torch.uint8)[3] ^= 0x10  # one flipped bit
    payload[index] = (name, corrupt)
    with pytest.raises(WeightSyncError, match="SHA-256") as err:
        engine.apply_lora_adapter(payload, 2, 60)
    if what == "tensor":
        assert name in str(err.value)
    assert engine.weight_version == 1 and engine.lora_adapter_id == "step-1"
    assert all(torch.equal(v, state[k]) for k, v in engine.model.state_dict().items())
    assert engine.health(5) and engine.score(L.PROBES[:1], 60)  # still serving
