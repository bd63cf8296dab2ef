"""Sharded state of Megatron's non-distributed mixed-precision optimizer (`Float16OptimizerWithFloat16Params`, a
BF16/FP16 model with `trainer.distributed_optimizer: false`), built here instead of by its own
`sharded_state_dict`.

Megatron-core 0.19.2 numbers the inner (torch) optimizer's parameters as if its groups held only the FP32 main
copies of the BF16 parameters (it enumerates `float16_groups`), and pairs those main copies with the groups'
parameter numbers by position. torch numbers every parameter of the groups, the FP32 model parameters included
(they are optimised in place, where they stand in the group). With Beam's FP32 router weight in a BF16 model the
numberings differ from the router on: Megatron would store one parameter's Adam moments and main copy under
another parameter's key and shape (an assertion when the shapes differ, a silently shuffled checkpoint when they
agree), and the FP32 parameters' moments match no description at all.

Here each inner-optimizer parameter keeps torch's number and is described by the model parameter it stands for (a
main copy by its BF16 parameter, an FP32 parameter by itself). The result has the structure of Megatron's own
(`optimizer`: torch's state dict with sharded moments and a `common_step`; `fp32_from_fp16_params`: the sharded
main copies in `fp32_from_float16_groups` order), so Megatron's `load_state_dict` restores it unchanged.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)


class Float16OptimizerStateError(RuntimeError):
    """An optimizer parameter has no sharded description in the model's state dict."""


def is_float16_optimizer(sub) -> bool:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return isinstance(sub, Float16OptimizerWithFloat16Params)


def sharded_state_dict(sub, model_sharded_state_dict: dict, is_loading: bool) -> dict:
    """`sub.sharded_state_dict(model_sharded_state_dict, is_loading)` with torch's parameter numbering (see the
    module docstring). With `is_loading`, the moments are created (zeroed) first so that they can be described."""
    if is_loading:
        sub.init_state_fn(sub.optimizer, sub.config)
    state = sub.state_dict()
    inner = sub.optimizer.param_groups
    main_to_model = {id(main): low for lows, mains in zip(sub.float16_groups, sub.fp32_from_float16_groups)
                     for low, main in zip(lows, mains)}
    # torch's numbering: every parameter of every group, in order; each as the model parameter it stands for.
    in_torch_order = [main_to_model.get(id(p), p) for group in inner for p in group["params"]]
    id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, in_torch_order)
    missing = [i for i in range(len(in_torch_order)) if i not in id_to_sharded]
    if missing:
        p = in_torch_order[missing[0]]
        raise Float16OptimizerStateError(
            f"{len(missing)} optimizer parameter(s) have no sharded description in the model's state dict (the "
            f"first: number {missing[0]}, shape {tuple(p.shape)}, {p.dtype})")
    number = {id(p): i for i, p in enumerate(p for group in inner for p in group["params"])}

    step = sub._extract_common_per_param_step(state["optimizer"])
    # Megatron's own conversion, now with the right numbers; the step is one value for all (as Megatron stores it).
    optim_state_to_sharding_state(state["optimizer"], id_to_sharded, exclude_keys="step")
    if step:
        state["optimizer"]["state"]["common_step"] = step
    state["fp32_from_fp16_params"] = [
        [make_sharded_optimizer_tensor(id_to_sharded[number[id(main)]], main, prefix="optimizer.state.fp32_param")
         for main in mains]
        for mains in sub.fp32_from_float16_groups]
    return state
