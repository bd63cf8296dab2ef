"""The in-process receiver (base of the test fakes) and the native engine meet the receiver contract; the SGLang
CPU engine is held to the same contract in transports/test_sglang_engine.py."""

import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.rollout.native.engine import NativeEngine
from beamrl.sync.local_receiver import LocalWeightReceiver, model_receiver

from .contract import check_receiver_contract


def tiny_model():
    return BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()


def test_local_receiver_meets_contract():
    model = tiny_model()
    receiver = model_receiver(model, name="local")
    assert isinstance(receiver, LocalWeightReceiver)
    check_receiver_contract(receiver, lambda: receiver.weight_version, model)


def test_native_engine_meets_contract():
    model = tiny_model()
    engine = NativeEngine.from_model(model, name="native-contract")
    try:
        check_receiver_contract(engine, lambda: engine.weight_version, model)
    finally:
        engine.shutdown()
