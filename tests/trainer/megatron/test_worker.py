"""Trainer configuration: every invalid setting is refused with the field's name, before any process group."""

import pytest

from beamrl.config import ConfigError
from beamrl.models.beam import preset
from beamrl.trainer.megatron.config import TrainerConfig
from beamrl.trainer.megatron.worker import (LRSchedule, TrainerConfigError, TrainerSetup, _split_sequences,
                                           megatron_optimizer_config)
from beamrl.trainer.protocol import PackedBatch


def _trainer(**kwargs) -> TrainerConfig:
    return TrainerConfig(**{"num_gpus": 2, "global_batch_size": 2, "lr": 1e-3, **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    (dict(decay_style="step"), "decay_style"),
    (dict(warmup_steps=-1), "warmup_steps"),
])
def test_lr_schedule_errors(kwargs, match):
    with pytest.raises(TrainerConfigError, match=match):
        LRSchedule(**kwargs)


def test_setup_checks_dtype_min_lr_and_layout():
    with pytest.raises(TrainerConfigError, match="dtype='float16'"):
        TrainerSetup(model=preset("tiny"), trainer=_trainer(), dtype="float16")
    with pytest.raises(TrainerConfigError, match="min_lr"):
        TrainerSetup(model=preset("tiny"), trainer=_trainer(), lr_schedule=LRSchedule(min_lr=1e-2))
    with pytest.raises(ConfigError, match="vpp=2: must divide the layers per pipeline stage"):  # tiny: 6 layers
        TrainerSetup(model=preset("tiny"), trainer=_trainer(pp=2, vpp=2, num_gpus=2))
    setup = TrainerSetup(model=preset("tiny"), trainer=_trainer(pp=2))
    assert setup.params_dtype.is_floating_point and setup.parallel.to_dict()["pp"] == 2


def test_split_sequences_keeps_alignment():
    b = PackedBatch.from_sequences([[1, 2], [3, 4, 5], [6, 7]], fields={"adv": [[1.0, 1.0], [2.0] * 3, [3.0] * 2]})
    parts = _split_sequences(b, 2)
    assert [p.tokens.tolist() for p in parts] == [[1, 2, 3, 4, 5], [6, 7]]
    assert [p.cu_seqlens.tolist() for p in parts] == [[0, 2, 5], [0, 2]]
    assert parts[1].fields["adv"].tolist() == [3.0, 3.0] and parts[1].loss_mask.tolist() == [0.0, 1.0]
    assert _split_sequences(b, 8) == [b]


@pytest.mark.parametrize("grad_clip, clip_grad", [(0.5, 0.5), (None, 0.0)])
def test_grad_clip_reaches_megatron_and_null_turns_clipping_off(grad_clip, clip_grad):
    """Megatron clips only when clip_grad > 0; recipes refuse inf, so null is the way to say "no clipping"."""
    setup = TrainerSetup(model=preset("tiny"), trainer=_trainer(grad_clip=grad_clip))
    assert megatron_optimizer_config(setup).clip_grad == clip_grad
    with pytest.raises(ValueError, match="grad_clip"):  # pydantic's error, named (a recipe gets a ConfigError)
        _trainer(grad_clip=0.0)


def test_a_rank_on_the_wrong_kind_of_device_says_so_instead_of_training_there():
    import torch

    from beamrl.trainer.megatron.parallel import device_for_rank

    here, other = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu", "cuda")
    assert device_for_rank(here).type == here and device_for_rank(None).type == here
    with pytest.raises(RuntimeError, match=f"cluster.device='{other}'"):
        device_for_rank(other)
    with pytest.raises(TrainerConfigError, match="device"):
        TrainerSetup(model=preset("tiny"), trainer=_trainer(), device="tpu")
