"""The native engine's weight release on a GPU (GPU-only): with `weights_cpu_backup` the weights go to pinned host
buffers that are reused across cycles and come back bit-exactly; without it the device memory is freed with no
copy and the engine serves again only after a full weight update."""

import pytest
import torch

from beamrl.models.beam import BeamForCausalLM, preset
from beamrl.models.beam.weights import random_state_dict
from beamrl.protocols.rollout import EngineError, GenerateRequest, SamplingParams
from beamrl.rollout.native import NativeEngine, NativeEngineConfig
from beamrl.sync.packing import pack_session

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the CUDA release path")

T_OUT = 120.0


def _engine(backup: bool) -> NativeEngine:
    model = BeamForCausalLM(preset("tiny"), dtype=torch.bfloat16, seed=1, device="cuda")
    return NativeEngine(NativeEngineConfig(model_path="<in-memory>", dtype="bfloat16", device="cuda",
                                           weights_cpu_backup=backup), model)


def _reqs():
    return [GenerateRequest(prompt_ids=[5, 9, 33], sampling=SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))]


def test_backup_is_pinned_reused_and_exact():
    engine = _engine(backup=True)
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.release_memory(["weights"], T_OUT)
        assert engine.model.lm_head.weight.numel() == 0
        host = engine._host_weights["lm_head.weight"]
        assert host.is_pinned() and host.device.type == "cpu"
        engine.resume_memory(["weights"], T_OUT)
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
        engine.release_memory(["weights"], T_OUT)
        assert engine._host_weights["lm_head.weight"].data_ptr() == host.data_ptr()  # reused, not reallocated
        engine.resume_memory(["weights"], T_OUT)
        engine.generate(_reqs(), T_OUT)
    finally:
        engine.shutdown()


def test_without_backup_the_memory_is_freed_and_a_full_sync_restores_service():
    engine = _engine(backup=False)
    try:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        engine.release_memory(["weights"], T_OUT)
        assert held - torch.cuda.memory_allocated() >= weights and not engine._host_weights
        engine.resume_memory(["weights"], T_OUT)
        with pytest.raises(EngineError, match="before the weights were loaded"):
            engine.generate(_reqs(), T_OUT)
        new = random_state_dict(preset("tiny"), seed=2, dtype=torch.bfloat16)
        manifest, buckets = pack_session(list(new.items()), 1, 1 << 17)
        engine.begin_weight_update(manifest, T_OUT)
        for b in buckets:
            engine.update_weights_from_tensor(b, T_OUT)
        engine.end_weight_update(1, T_OUT)
        assert all(torch.equal(v.cpu(), new[k]) for k, v in engine.model.state_dict().items())
        engine.generate(_reqs(), T_OUT)
    finally:
        engine.shutdown()
