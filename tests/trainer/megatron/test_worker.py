"""Trainer configuration: every invalid setting is refused with the field's name, before any process group."""

import pytest

from beamrl.models.beam import preset
from beamrl.trainer.megatron.parallel import ParallelConfig, ParallelConfigError
from beamrl.trainer.megatron.worker import OptimizerSettings, TrainerConfig, TrainerConfigError, _split_sequences
from beamrl.trainer.protocol import PackedBatch


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "lr=0.0"),
    (dict(lr=1e-3, min_lr=1e-2), "min_lr"),
    (dict(clip_grad=-1.0), "clip_grad"),
    (dict(decay_style="step"), "decay_style"),
    (dict(warmup_steps=-1), "warmup_steps"),
])
def test_optimizer_settings_errors(kwargs, match):
    with pytest.raises(TrainerConfigError, match=match):
        OptimizerSettings(**kwargs)


def test_trainer_config_checks_dtype_and_layout():
    with pytest.raises(TrainerConfigError, match="dtype='float16'"):
        TrainerConfig(model=preset("tiny"), dtype="float16")
    with pytest.raises(ParallelConfigError, match="pp\\*vpp = 4"):  # tiny has 6 layers
        TrainerConfig(model=preset("tiny"), parallel=ParallelConfig(pp=2, vpp=2))
    assert TrainerConfig(model=preset("tiny"), parallel=ParallelConfig(pp=2)).params_dtype.is_floating_point


def test_split_sequences_keeps_alignment():
    b = PackedBatch.from_sequences([[1, 2], [3, 4, 5], [6, 7]], fields={"adv": [[1.0, 1.0], [2.0] * 3, [3.0] * 2]})
    parts = _split_sequences(b, 2)
    assert [p.tokens.tolist() for p in parts] == [[1, 2, 3, 4, 5], [6, 7]]
    assert [p.cu_seqlens.tolist() for p in parts] == [[0, 2, 5], [0, 2]]
    assert parts[1].fields["adv"].tolist() == [3.0, 3.0] and parts[1].loss_mask.tolist() == [0.0, 1.0]
    assert _split_sequences(b, 8) == [b]
