"""What a trainer checkpoint holds, as Megatron sharded state: the model chunks and the optimizer.

- Model: every chunk's `sharded_state_dict` (Beam's modules describe their TP/EP-split tensors, see
  `model/sharding.py`), keys are global (layer numbers are global, experts are one tensor over EP), so they do not
  depend on the layout. Megatron's `_extra_state` slots of the local linears hold nothing and are dropped.
- Optimizer: every parameter's FP32 main copy and Adam moments as tensors of the parameter's own shape and
  sharding (Megatron's `fully_reshardable` format), so they reshard like the weights. The distributed optimizer's
  is described by `distributed_optimizer` (each DP rank writes and reads only the state it owns; Megatron's own
  description gathers it over DP), the non-distributed one natively (in a BF16 model by `float16_optimizer`, not
  by Megatron, which misnumbers its parameters next to FP32 ones). Sub-optimizer prefixes are off
  (`chained_optim_avoid_prefix`): the chain's make-up depends on the layout.

The non-tensor part of the optimizer state (parameter-group hyper-parameters) is not stored: it is rebuilt from
the trainer's own settings on load. Adam's step count, the one non-tensor value that matters, is stored in the
checkpoint's JSON and set on load (`load_optimizer`).
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from beamrl.trainer.megatron.checkpoint import distributed_optimizer, float16_optimizer

#: Metadata passed to Megatron's `sharded_state_dict` calls (models, the FP32 optimizer), and recorded in the
#: checkpoint's JSON as the layout of its optimizer state (`OPTIMIZER_STATE_FORMAT`, checked on load).
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}
#: The optimizer state format this code writes and reads (Megatron's name for it).
OPTIMIZER_STATE_FORMAT = SHARDING_METADATA["distrib_optim_sharding_type"]
MODEL_PREFIX = "model."


class StateError(RuntimeError):
    """The trainer's state cannot be expressed as (or restored from) sharded tensors; the message says why."""


def sharded_state(trainer, is_loading: bool) -> tuple[dict, dict]:
    """(sharded part, non-tensor part) of the trainer's model + optimizer state. Local: no collective."""
    model = {f"chunk{i}": _model_chunk(m) for i, m in enumerate(trainer.models)}
    _align_param_index_maps(trainer.optimizer)
    if is_loading:
        _create_adam_state(trainer.optimizer)
    optimizer = _optimizer_sharded_state(trainer.optimizer, model, is_loading)
    sharded, common = extract_sharded_base({"model": model, "optimizer": optimizer})
    # Values marked "not stored" (e.g. parameter-group index lists) are this trainer's own: keep them as they are.
    dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, common)
    return sharded, common


def _optimizer_sharded_state(optimizer, model: dict, is_loading: bool):
    """The (chained) optimizer's `sharded_state_dict`, as Megatron's `ChainedOptimizer` builds it without prefixes
    (one dict per sub-optimizer, or the single one's), except that the distributed sub-optimizers are described by
    `distributed_optimizer` (no gather over DP) and the non-distributed mixed-precision ones by `float16_optimizer`
    (Megatron 0.19.2 misnumbers their parameters next to FP32 ones, see there)."""
    subs = _sub_optimizers(optimizer)
    if len(subs) > 1:
        optimizer._synchronize_steps()  # as ChainedOptimizer does (TE/Apex keep the step per group)
    parts = [distributed_optimizer.sharded_state_dict(sub, model, is_loading) if _is_distributed(sub)
             else float16_optimizer.sharded_state_dict(sub, model, is_loading)
             if float16_optimizer.is_float16_optimizer(sub)
             else sub.sharded_state_dict(model, is_loading=is_loading, metadata=dict(SHARDING_METADATA))
             for sub in subs]
    return dict(enumerate(parts)) if len(subs) > 1 else parts[0]


def _align_param_index_maps(optimizer) -> None:
    """Megatron 0.19.2's distributed optimizer records each parameter's place in its inner optimizer's groups
    (`model_param_group_index_map`) in gradient-buffer order, but lays every group out FP32 parameters first
    (`_build_model_and_main_param_groups`). With Beam's FP32 router weight in a BF16 model the two orders differ,
    and its checkpoint code would read and write other parameters' main copies and moments (a size mismatch at
    best). Re-record the places in the inner optimizer's actual order; only the checkpoint code reads them."""
    for sub in _sub_optimizers(optimizer):
        if not _is_distributed(sub):
            continue
        aligned = {}
        for g, (fp32, low) in enumerate(zip(sub.model_fp32_groups, sub.model_float16_groups)):
            for i, p in enumerate([*fp32, *low]):
                aligned[p] = (g, i)
        if aligned.keys() != sub.model_param_group_index_map.keys():
            raise StateError("the distributed optimizer's parameter groups do not cover its parameters")
        sub.model_param_group_index_map = aligned


def _create_adam_state(optimizer) -> None:
    """torch's Adam creates its per-parameter state (moments and step) on the first update, and Megatron's
    distributed optimizer needs it to describe itself for loading. Create it, zeroed, as that update would (the
    load overwrites it). TE/Apex fused Adam keep the step in the parameter groups and need nothing."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if HAVE_APEX_OR_TE:
        return
    for sub in _sub_optimizers(optimizer):
        if _is_distributed(sub) and isinstance(sub.optimizer, torch.optim.Adam):
            sub.init_state_fn(sub.optimizer, sub.config)
            for param_state in sub.optimizer.state.values():
                param_state.setdefault("step", torch.tensor(0.0))


def _model_chunk(model) -> dict:
    sd = model.sharded_state_dict(prefix=MODEL_PREFIX, metadata=dict(SHARDING_METADATA))
    out = {}
    for key, value in sd.items():
        if isinstance(value, ShardedObject):
            if key.endswith("_extra_state") and value.data is None:
                continue  # local (non-TE) linears keep no extra state
            raise StateError(f"{key}: a non-tensor module state ({type(value.data).__name__}); beamrl checkpoints "
                             f"store tensors only")
        out[key] = value
    return out


def load_model(trainer, loaded: dict) -> None:
    """Copy loaded chunk state dicts into the model chunks (strict, except the dropped `_extra_state` slots)."""
    for i, model in enumerate(trainer.models):
        sd = {k[len(MODEL_PREFIX):]: v for k, v in loaded["model"][f"chunk{i}"].items()}
        result = model.load_state_dict(sd, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise StateError(f"model chunk {i}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _per_sub(optimizer, optimizer_state) -> list[dict]:
    subs = _sub_optimizers(optimizer)
    return [optimizer_state[i] for i in range(len(subs))] if len(subs) > 1 else [optimizer_state]


def _is_distributed(sub) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(sub, DistributedOptimizer)


def _step_slots(sub, state: dict):
    """Where Adam's step lives in one sub-optimizer's non-tensor state: (groups, key) pairs to read/write."""
    if _is_distributed(sub):
        return [(g, "step") for g in state["optimizer"]["param_groups"]]
    inner = state["optimizer"] if "optimizer" in state else state  # Float16 wraps the torch state; FP32 does not
    return [(inner["state"], "common_step")]


def adam_step(trainer, common: dict) -> int:
    """Adam's step count from the non-tensor part of `sharded_state` (saving); 0 before the first update."""
    steps = set()
    for sub, state in zip(_sub_optimizers(trainer.optimizer), _per_sub(trainer.optimizer, common["optimizer"])):
        for slot, key in _step_slots(sub, state):
            value = slot.get(key)
            steps.add(int(value.item() if isinstance(value, torch.Tensor) else (value or 0)))
    if len(steps) > 1:
        raise StateError(f"the sub-optimizers disagree on Adam's step count: {sorted(steps)}")
    return steps.pop() if steps else 0


def load_optimizer(trainer, merged: dict, step: int) -> None:
    """Load the optimizer part of a loaded `sharded_state` (non-tensor part rebuilt by this trainer) with Adam's
    step count `step`, one sub-optimizer at a time."""
    for sub, sd in zip(_sub_optimizers(trainer.optimizer), _per_sub(trainer.optimizer, merged["optimizer"])):
        for slot, key in _step_slots(sub, sd):
            slot[key] = float(step) if _is_distributed(sub) else torch.tensor(float(step))
        if _is_distributed(sub):
            distributed_optimizer.load_state_dict(sub, sd)
        else:
            sub.load_state_dict(sd)
