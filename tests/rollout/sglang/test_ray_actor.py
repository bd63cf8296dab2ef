"""The production placement: a Ray actor owns an SGLang server (CPU engine here); the handle talks HTTP to it."""

import math

import pytest
import ray
import torch

from beamrl.models.beam import preset
from beamrl.net import reserve_port


@pytest.mark.slow
def test_ray_actor_serves_and_shuts_down(tmp_path):
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.protocols.rollout import GenerateRequest, SamplingParams
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.ray_actor import launch_ray_engine

    config = preset("tiny")
    save_checkpoint(config, random_state_dict(config, 1, torch.bfloat16), tmp_path)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)  # never join a cluster left running
    try:
        with reserve_port() as reserved:  # held until the actor's server has bound it
            handle = launch_ray_engine(SGLangEngineConfig.on_cpu(tmp_path, dtype="float32", port=reserved.port),
                                       start_timeout=900)
        try:
            prompt = [1, 2, 3, 4]
            (res,) = handle.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True),
                                                      return_routed_experts=True)], timeout=300)
            # ignore_eos: exactly max_new_tokens tokens come back over HTTP, each with a finite logprob <= 0
            assert len(res.output_ids) == 3 and res.finish_reason == "length"
            assert res.prompt_ids == prompt and res.weight_version == 0
            assert all(math.isfinite(lp) and lp <= 0 for lp in res.output_logprobs)
            # routes: one row per token that went through the model (prompt + output - 1), every layer, top-k
            assert res.routed_experts.shape == (len(prompt) + 3 - 1, config.num_hidden_layers,
                                                config.num_experts_per_tok)
            moe = res.routed_experts[:, config.moe_layers]
            assert ((moe >= 0) & (moe < config.num_experts)).all()
            assert handle.health(timeout=60)
        finally:
            handle.shutdown()
        assert handle.health(timeout=5) is False
    finally:
        if started:
            ray.shutdown()
