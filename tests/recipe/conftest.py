"""Shared recipe fixtures: a small valid GPU recipe as a raw mapping, to break one field at a time."""

import copy

import pytest

# 2 nodes x 8 GPUs, disaggregated: 8 trainer GPUs (TP2 x DP4 with EP4) + 2 engines of TP4. Tiny Beam.
BASE = {
    "run": {"name": "unit", "num_steps": 2},
    "model": {"preset": "tiny", "seed": 0},
    "cluster": {"device": "cuda", "num_nodes": 2, "gpus_per_node": 8, "gpu_type": "h200"},
    "trainer": {"num_gpus": 8, "tp": 2, "sp": True, "ep": 4, "etp": 1, "pp": 1, "micro_batch_size": 1,
                "global_batch_size": 16, "lr": 1e-6},
    "rollout": {"engine": "sglang", "num_engines": 2, "engine_tp": 4, "max_new_tokens": 64,
                "n_samples_per_prompt": 4, "prompts_per_step": 8},
    "placement": {"mode": "disaggregated", "off_policy_steps": 0},
    "rewards": [{"name": "exact", "fn": "beamrl.recipe.errors:RecipeError"}],
    "data": {"format": "jsonl-prompt-answer", "source": "data.jsonl", "max_prompt_len": 64},
    "sync": {"transport": "distributed"},
}


@pytest.fixture
def base_raw():
    return copy.deepcopy(BASE)
