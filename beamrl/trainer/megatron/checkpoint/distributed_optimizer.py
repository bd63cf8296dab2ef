"""Sharded state of Megatron's distributed optimizer in which every DP rank describes, writes and reads only the
optimizer state it owns, built here instead of by the optimizer's own `sharded_state_dict`.

What is stored is exactly Megatron's `fully_reshardable` model-space format: for every parameter, its FP32 main
copy and Adam moments as FP32 tensors `optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>` of the
parameter's own global shape and sharding (a factory-described parameter, e.g. the GLU fc1, through its factory).
Only the chunking differs. Megatron builds that format by gathering the whole state of every model-parallel shard
over DP onto DP rank 0 (zero-filled host buffers, a gather that copies even at DP 1, concatenations), which then
writes it: the part of a save the step waits for, and a memory problem at scale. Here each DP rank describes the
flat range of each parameter it owns (`param_range` of its buffer shard) as the few boxes of the parameter's
global tensor that range covers, with views of the optimizer's own tensors as data: no gather, no buffer, no copy,
and every DP rank writes its share. DCP stores boxes of any size and reads any box from them, so the resulting
checkpoints and those written by Megatron's gather load either way, at any layout.

Loading reads the same boxes for the loading rank's own ranges, straight into the optimizer's tensors (every
rank reads only what it owns, instead of the whole shard of every parameter it has a part of).

Megatron 0.19.2's own gather-free format (`fully_sharded_model_space`, deprecated upstream) cannot be used: it
describes each rank's range as a `flattened_range` ShardedTensor, which 0.19.2's `ShardedTensor` refuses on
construction ("flattened_range is not supported").
"""

from __future__ import annotations

import math

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

#: Key prefix of the optimizer state tensors, as in Megatron's `fully_reshardable` format.
STATE_PREFIX = "optimizer.state"
#: The state that keys are stored in (Megatron's world-tensor dtype for this format).
STATE_DTYPE = torch.float32


class DistributedOptimizerStateError(RuntimeError):
    """The distributed optimizer's state cannot be described as boxes of the model's tensors; the message says
    why."""


def sharded_state_dict(sub, model_sharded_state_dict: dict, is_loading: bool) -> dict:
    """The distributed optimizer `sub`'s state: its non-tensor `state_dict()` plus `param_state`, this DP rank's
    own shards as `{param number: {state key: {box number: ShardedTensor}}}`, boxes in flat order. With
    `is_loading`, the optimizer's state is allocated first (as Megatron does), so that the boxes are views of the
    tensors the load fills."""
    if sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        raise DistributedOptimizerStateError(
            "the precision-aware distributed optimizer keeps scaled state copies; beamrl checkpoints describe the "
            "optimizer's own FP32 tensors")
    if is_loading:
        sub.load_state_dict(sub.state_dict())
    state = sub.state_dict()
    state["param_state"] = _own_shards(sub, model_sharded_state_dict)
    return state


def load_state_dict(sub, state: dict) -> None:
    """Restore `sub` from a loaded `sharded_state_dict` (its non-tensor part rebuilt by this trainer, with Adam's
    step count set in the parameter groups). The tensors were read into the optimizer's own tensors by the load;
    a box that came back as a separate tensor is copied into place."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    param_state = state.pop("param_state", {})
    targets = _own_tensors(sub)
    if param_state.keys() != targets.keys():
        raise DistributedOptimizerStateError(f"loaded optimizer state for {len(param_state)} parameters, this rank "
                                             f"owns parts of {len(targets)}")
    with torch.no_grad():
        for number, tensors in targets.items():
            for key, target in tensors.items():
                at = 0
                for box in (param_state[number][key][i] for i in range(len(param_state[number][key]))):
                    piece = target[at:at + box.numel()]
                    if piece.data_ptr() != box.data_ptr():
                        piece.copy_(box.reshape(-1))
                    at += box.numel()
                if at != target.numel():
                    raise DistributedOptimizerStateError(f"parameter {number} {key}: loaded {at} elements, this rank "
                                                         f"owns {target.numel()}")
    sub.load_state_dict(state)
    inner = sub.optimizer
    # Megatron gives every parameter the *same* torch-Adam `step` tensor, which Adam then increments in place once
    # per parameter: each parameter gets its own.
    for per_param in inner.state.values():
        if isinstance(per_param.get("step"), torch.Tensor):
            per_param["step"] = per_param["step"].detach().clone()
    if isinstance(inner, HybridDeviceOptimizer):
        inner._sync_hdo_state_to_sub_optimizers()  # as Megatron's own loaders do


def _owned_params(sub):
    """(number, model parameter, its flat range owned by this DP rank), in the distributed optimizer's buffer
    order (the numbering `sharded_state_dict` and `load_state_dict` share)."""
    number = 0
    for gbuf_range_maps in sub.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for model_param, ranges in bucket["param_map"].items():
                    yield number, model_param, ranges["param"]
                    number += 1


def _own_tensors(sub) -> dict[int, dict[str, torch.Tensor]]:
    """This DP rank's flat main copy and moments of every parameter it owns a part of: the optimizer's own
    tensors (views of its buffers)."""
    keys = ("param",) + tuple(sub.optimizer_state_keys)
    out = {}
    for number, model_param, rng in _owned_params(sub):
        tensors = sub._get_main_param_and_optimizer_states(model_param)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise DistributedOptimizerStateError(f"parameter {number} ({tuple(model_param.shape)}): the optimizer "
                                                 f"has no {missing} state")
        for k in keys:
            t = tensors[k]
            if t.dtype != STATE_DTYPE or t.dim() != 1 or t.numel() != rng.size:
                raise DistributedOptimizerStateError(
                    f"parameter {number} ({tuple(model_param.shape)}): its {k} state is {t.dtype} of shape "
                    f"{tuple(t.shape)}, expected a flat {STATE_DTYPE} range of {rng.size} elements")
        out[number] = {k: tensors[k] for k in keys}
    return out


def _own_shards(sub, model_sharded_state_dict: dict) -> dict:
    described = {}
    model_sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    for sh in nested_values(model_sharded):
        described[id(sh.data)] = sh
    tensors = _own_tensors(sub)
    out = {}
    for number, model_param, rng in _owned_params(sub):
        sh = described.get(id(model_param))
        if sh is None:
            raise DistributedOptimizerStateError(f"parameter {number} ({tuple(model_param.shape)}) has no sharded "
                                                 f"description in the model's state dict")
        if len(sh.replica_id) != 3:
            raise DistributedOptimizerStateError(f"{sh.key}: replica id {sh.replica_id}, expected (PP, TP, DP)")
        # Every element is owned by one DP rank: the DP coordinate is the optimizer instance's (0 = main).
        replica_id = (*sh.replica_id[:2], sub.distributed_optimizer_instance_id)
        out[number] = {key: owned_boxes(sh, f"{STATE_PREFIX}.{key}.{sh.key}", flat, rng.start, rng.end, replica_id)
                       for key, flat in tensors[number].items()}
    return out


def owned_boxes(sh, key: str, flat: torch.Tensor, start: int, end: int, replica_id) -> dict[int, ShardedTensor]:
    """The elements [start, end) of the row-major flattened local tensor that `sh` (a ShardedTensor or factory)
    describes, held by `flat`, as ShardedTensors of `sh`'s global tensor(s) under `key`, in flat order."""
    parts = []  # (flat start in the local tensor, local shape, prepend axes, global offset, key)
    if isinstance(sh, ShardedTensorFactory):
        # The factory's outputs are views of the local tensor (e.g. the GLU's gate and up halves); where each lies
        # in it comes from building them over a storage-less tensor.
        probe = torch.empty(sh.data.shape, dtype=STATE_DTYPE, device="meta")
        for out in nested_values(sh.build_fn(key, probe, replica_id, None)):
            if not (out.data is probe or out.data._base is probe) or not out.data.is_contiguous():
                raise DistributedOptimizerStateError(f"{sh.key}: its factory builds a tensor that is not a "
                                                     f"contiguous part of the parameter")
            parts.append((out.data.storage_offset(), out.local_shape, out.prepend_axis_num, out.global_offset,
                          out.key, out.global_shape))
    else:
        parts.append((0, sh.local_shape, sh.prepend_axis_num, sh.global_offset, key, sh.global_shape))
    boxes = []
    for part_start, shape, prepend, global_offset, part_key, global_shape in parts:
        lo, hi = max(start, part_start), min(end, part_start + math.prod(shape))
        for offset, size, at in flat_range_boxes(tuple(shape), lo - part_start, hi - part_start):
            n = math.prod(size)
            first = part_start + at - start  # in `flat`
            boxes.append((part_start + at, ShardedTensor(
                key=part_key, data=flat[first:first + n].view((1,) * prepend + size), dtype=STATE_DTYPE,
                local_shape=(1,) * prepend + size, global_shape=tuple(global_shape),
                global_offset=tuple(global_offset[:prepend]) + tuple(
                    g + o for g, o in zip(global_offset[prepend:], offset)),
                axis_fragmentations=None, replica_id=replica_id)))
    boxes.sort(key=lambda b: b[0])
    return {i: box for i, (_, box) in enumerate(boxes)}


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple, tuple, int]]:
    """The elements [start, end) of a row-major tensor of `shape` as boxes `(offset, size, flat start)`, in flat
    order: a partial leading row, whole rows, a partial trailing row, recursively (at most 2 * ndim - 1 boxes).
    Each box is a contiguous run of the flattened tensor."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), start)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def in_row(row, lo, hi):
        return [((row, *o), (1, *s), row * inner + at) for o, s, at in flat_range_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if c1:
        out += in_row(r1, 0, c1)
    return out
