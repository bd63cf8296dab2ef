"""The production placement: a Ray actor owns an SGLang server (CPU engine here); the handle talks HTTP to it."""

import socket

import pytest
import torch

from beamrl.models.beam import preset


@pytest.mark.slow
def test_ray_actor_serves_and_shuts_down(tmp_path):
    ray = pytest.importorskip("ray")
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.protocols.rollout import GenerateRequest, SamplingParams
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.ray_actor import launch_ray_engine

    config = preset("tiny")
    save_checkpoint(config, random_state_dict(config, 1, torch.bfloat16), tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False)
    try:
        handle = launch_ray_engine(SGLangEngineConfig.on_cpu(tmp_path, dtype="float32", port=port),
                                   start_timeout=900)
        try:
            (res,) = handle.generate([GenerateRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=3),
                                                      return_routed_experts=True)], timeout=300)
            assert len(res.output_ids) <= 3 and res.routed_experts.shape[1:] == (6, 4)
            assert handle.health(timeout=60)
        finally:
            handle.shutdown()
        assert handle.health(timeout=5) is False
    finally:
        if started:
            ray.shutdown()
