"""A resumed run trains with its own lr and weight decay, from the checkpoint's position in the schedule (Megatron's
default took the schedule's settings and the weight decay from the checkpoint, while the optimizer's groups carried
the new lr: the weight decay went back to the checkpoint's after one step)."""

import pytest
import torch

from beamrl.trainer.megatron.scheduler import build_scheduler
from beamrl.trainer.megatron.worker import LRSchedule


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)


def test_a_resume_with_other_settings_uses_them_from_the_checkpoints_step():
    first = build_scheduler(_optimizer(), lr=5e-4, weight_decay=0.0, schedule=LRSchedule())
    for _ in range(3):
        first.step(1)
    state = first.state_dict()
    opt = _optimizer()
    resumed = build_scheduler(opt, lr=1e-3, weight_decay=0.1, schedule=LRSchedule())
    resumed.load_state_dict(state)
    assert resumed.num_steps == 3
    for _ in range(3):
        resumed.step(1)
        (group,) = opt.param_groups
        assert group["lr"] == pytest.approx(1e-3) and group["weight_decay"] == pytest.approx(0.1)


def test_the_schedule_continues_where_the_checkpoint_left_it():
    schedule = LRSchedule(warmup_steps=10, decay_steps=10, decay_style="linear")
    first = build_scheduler(_optimizer(), lr=1e-3, weight_decay=0.0, schedule=schedule)
    for _ in range(5):
        first.step(1)
    opt = _optimizer()
    resumed = build_scheduler(opt, lr=1e-3, weight_decay=0.0, schedule=schedule)
    resumed.load_state_dict(first.state_dict())
    resumed.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 6 / 10)  # step 6 of the 10-step warm-up
