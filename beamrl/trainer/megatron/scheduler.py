"""The optimizer's LR and weight-decay schedule (Megatron's `OptimizerParamScheduler`), built from this run's settings.

On resume, the checkpoint gives the schedule's position (its step count) and this run gives every setting: lr,
`LRSchedule` (min_lr, warmup, decay) and weight decay (`override_opt_param_scheduler`). Megatron's default takes the
schedule's settings and the weight decay from the checkpoint while the optimizer's parameter groups carry this run's
lr, so a run resumed with another lr or weight decay trained with a mix of both (the weight decay went back to the
checkpoint's after one step) while the log said this run's settings applied.
"""

from __future__ import annotations


def build_scheduler(optimizer, lr: float, weight_decay: float, schedule):
    """The scheduler of `optimizer` for peak `lr`, constant `weight_decay` and `schedule` (`LRSchedule`)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if schedule.warmup_steps else lr, max_lr=lr, min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps, lr_decay_steps=schedule.warmup_steps + schedule.decay_steps,
        lr_decay_style=schedule.decay_style, start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=1,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
