"""Calls across the actor boundary cannot swap two flags: after its first argument, every trainer-rank method that
takes flags accepts them by keyword only (a positional call fails at once instead of training with the flags
exchanged)."""

import inspect

import pytest

from beamrl.loop.actors import TrainerActor


@pytest.mark.parametrize("method", ["compute_logprobs", "train_step", "sync_weights"])
def test_trainer_rank_flags_are_keyword_only(method):
    params = list(inspect.signature(getattr(TrainerActor.__ray_actor_class__, method)).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert len(positional) <= 1, f"TrainerActor.{method}: {positional[1:]} can be passed positionally"
