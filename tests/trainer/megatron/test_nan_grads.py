"""A backward with non-finite gradients fails loudly, before any update: the weights stay as they were (without a
loss scaler, Megatron's optimizer applied NaN gradients, and `optimizer_step` reported the step as taken)."""

import math

import torch

from beamrl.trainer.megatron.launch import LaunchError, launch

from . import _equivalence as E


def _nan_step() -> dict:
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.worker import MegatronTrainer

    cfg = E.trainer_config({})
    trainer = MegatronTrainer(cfg)
    trainer.load_hf_state_dict(random_state_dict(cfg.model, E.WEIGHT_SEED, torch.float32))
    before = {k: v.clone() for unit in trainer.export_hf() for k, v in unit}

    def nan_loss(logprobs, entropy, batch):
        return (logprobs * batch.loss_mask).sum() * math.nan, {}

    try:
        trainer.train_step(E.micro_batches()[:1], nan_loss)
        error = None
    except Exception as e:  # noqa: BLE001 - what the test inspects
        error = f"{type(e).__name__}: {e}"
    after = {k: v for unit in trainer.export_hf() for k, v in unit}
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_nan_gradients_raise_before_the_update():
    try:
        out = launch(_nan_step, 1, timeout_s=300)[0]
    except LaunchError as e:  # raised outside the try above (e.g. while building): show it
        raise AssertionError(str(e)) from None
    assert out["error"] is not None and "NaN" in out["error"], out["error"]
    assert out["unchanged"], "the weights changed although the gradients were NaN"
