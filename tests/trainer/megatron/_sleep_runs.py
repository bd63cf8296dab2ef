"""Rank function of the sleep/wake test (2 processes through `beamrl.trainer.megatron.launch`).

One launch covers the sharded case (TP2+SP, distributed optimizer, bf16: FP32 main params and Adam state are
shards, params and grads live in Megatron's contiguous buffers): a trainer trains K steps, sleeps (every released
storage must have 0 bytes), wakes (every tensor bit-identical to a snapshot taken before the sleep, except the
gradients, which are dropped and come back as zeros) and trains N more; a second trainer, rebuilt from the same
weights in the same processes, trains K + N steps without sleeping. The losses must be identical.
"""

from __future__ import annotations

import torch

from tests.trainer.megatron import _checkpoint_runs as C
from tests.trainer.megatron import _equivalence as E

K, N = 2, 2


def sleep_cycle(dtype: str, layout: dict | None = None) -> dict:
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.sleep import (GradientsPendingError, TrainerAsleepError, megatron_grad_tensors,
                                               megatron_state_tensors)

    layout = {"tp": 2, "sp": True} if layout is None else layout
    weights = None
    out: dict = {}
    for mode in ("sleep", "plain"):
        t = C._trainer(layout, distributed_optimizer=True, dtype=dtype)
        if weights is None:
            weights = random_state_dict(t.config.model, 7, t.config.params_dtype)
        t.load_hf_state_dict(weights)
        losses = C._train(t, K)
        if mode == "sleep":
            tensors = list(megatron_state_tensors(t.chunks, t.optimizer))
            grads = {id(g) for g in megatron_grad_tensors(t.chunks, t.optimizer)}
            before = [x.detach().clone() for x in tensors]
            allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            report = t.sleep()
            out["allocated_awake"] = allocated
            out["allocated_asleep"] = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            out["reserved_asleep"] = report.asleep_bytes
            out["peak"] = report.peak_bytes
            out["released_bytes"] = report.bytes
            out["dropped_bytes"] = report.dropped_bytes
            out["storages"] = report.storages
            # Only the rank's device storages are released (on CUDA, e.g. Adam's CPU `step` counters stay put)
            device = next(x.device for x in tensors if x.numel() > 1)
            on_device = [x for x in tensors if x.device == device]
            out["all_freed"] = len(on_device) > 10 and all(x.untyped_storage().nbytes() == 0 for x in on_device)
            out["not_freed"] = [f"{x.dtype} {tuple(x.shape)} on {x.device}" for x in on_device
                                if x.untyped_storage().nbytes()][:5]
            # the same, found independently of `megatron_state_tensors`: Adam state, FP32 main params, DDP buffers
            subs = getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]
            own = [v for sub in subs for st in sub.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.numel() > 1]
            own += [p for sub in subs for g in sub.optimizer.param_groups for p in g["params"]]
            own += [b for c in t.chunks for buf in c.buffers for b in (buf.param_data, buf.grad_data)
                    if b is not None]
            own += [p.main_grad for m in t.models for p in m.parameters()]
            own = [x for x in own if x.device == device]
            out["independent_freed"] = len(own) > 10 and all(x.untyped_storage().nbytes() == 0 for x in own)
            out["independent_not_freed"] = [f"{x.dtype} {tuple(x.shape)}" for x in own if x.untyped_storage().nbytes()][:5]
            subs = getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]
            out["adam_state_tensors"] = sum(len(s) for sub in subs for s in sub.optimizer.state.values())
            try:
                t.train_step([], None)
                out["refused_asleep"] = False
            except TrainerAsleepError as e:
                out["refused_asleep"] = "wake() first" in str(e)
            t.wake()
            # state bit-identical; a gradient comes back zero-filled (dropped) or bit-identical (its storage is
            # shared with state); at least one is dropped (the DDP grad buffers)
            out["bit_identical"] = all(torch.equal(_bits(a), _bits(b))
                                       for a, b in zip(tensors, before) if id(a) not in grads)
            out["grads_zero_or_kept"] = all(torch.equal(_bits(a), _bits(b)) or not a.any()
                                            for a, b in zip(tensors, before) if id(a) in grads)
            out["grads_dropped"] = any(not a.any() and b.any() for a, b in zip(tensors, before) if id(a) in grads)
            out["same_objects"] = len(tensors) == len(list(megatron_state_tensors(t.chunks, t.optimizer)))
        losses += C._train(t, N)
        out[f"losses_{mode}"] = losses
        if mode == "sleep":  # a sleep between a step's backward and its update would drop its gradients: refused
            mbs = E.micro_batches()
            t.forward_backward(mbs[:1], E.make_loss(sum(b.num_loss_tokens for b in mbs)))
            try:
                t.sleep()
                out["refused_pending"] = False
            except GradientsPendingError as e:
                out["refused_pending"] = "optimizer_step" in str(e)
            t.optimizer_step()
            # train()/eval() are skipped only when every module already is in the mode (a submodule switched on its
            # own is switched back)
            modules = [m for c in t.chunks for m in c.modules()]
            t.compute_logprobs(mbs[0])
            out["eval_for_logprobs"] = not any(m.training for m in modules)
            modules[-1].train()
            t.compute_logprobs(mbs[0])
            out["eval_again"] = not any(m.training for m in modules)
            t.train_step(mbs[:1], E.make_loss(sum(b.num_loss_tokens for b in mbs)))
            out["train_for_step"] = all(m.training for m in modules)
        t.shutdown()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (NaN == NaN, -0.0 != 0.0: a bit-exact comparison)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)
