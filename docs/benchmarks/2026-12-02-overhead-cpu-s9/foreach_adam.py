"""Megatron's torch AdamW on CPU (foreach off: torch's default for CPU tensors) against foreach on, alternating in
one process on the trainer's real optimizer after real train steps: CPU ms per optimizer step; then whether 6 train
steps end in the same parameters bit for bit (each mode from a fresh trainer)."""

import time

import torch

from _trainer import trainer_and_step


def optimizers(trainer):
    return [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]


def set_foreach(trainer, on: bool):
    for o in optimizers(trainer):
        for g in o.param_groups:
            g["foreach"] = on


trainer, step = trainer_and_step()
for _ in range(3):
    step()
times = {False: [], True: []}
for _ in range(30):
    for on in (False, True):
        set_foreach(trainer, on)
        t = time.thread_time()
        for o in optimizers(trainer):
            o.step()
        times[on].append(time.thread_time() - t)
for on, v in times.items():
    print(f"foreach={on}: optimizer step CPU ms min {min(v) * 1e3:.2f} median {sorted(v)[15] * 1e3:.2f}")
trainer.shutdown()
params = {}
for on in (False, True):
    trainer, step = trainer_and_step()
    set_foreach(trainer, on)
    for _ in range(6):
        step()
    params[on] = torch.cat([p.detach().reshape(-1) for c in trainer.chunks for p in c.parameters()])
    trainer.shutdown()
print("parameters after 6 steps bit-identical:", torch.equal(params[False], params[True]))
