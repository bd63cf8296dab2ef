"""LoRA adapters in the Megatron Beam modules (docs/lora.md "Trainer").

The forward of an adapted module runs with the merged weight `W' = merge_lora_weight(W0, A, B, s)`
(`beamrl.models.beam.lora`), the very tensor the engines compute, so training sees exactly what rollout serves.
Gradients reach A and B through `LoRAMerge`, straight through the final rounding:
`dA = s * B^T @ dW'`, `dB = s * dW' @ A^T` (FP32 GEMMs; the gradients need no bit-exactness).

The base weights stay where they are (frozen by `freeze_base`: `requires_grad=False`, so they are in neither the
DDP grad buffers nor the optimizer); W' is a temporary of each forward, like an activation, and W0 is never copied.

Sharding (each factor shards like the dimension of W0 it spans):
- column-parallel bases (`linear_qkv`, `linear_fc1`): B [local rows, r] by output rows, A [r, in] replicated;
- row-parallel bases (`linear_proj`, `linear_fc2`): A [r, local in] by input columns, B [out, r] replicated;
- experts: per local expert (EP), A [E_local, r, in] / B [E_local, out, r]; with `share_expert_a` one A per
  projection, stored as EP column shards [r, in/EP] and all-gathered for the merge (a replicated parameter would
  be counted once per EP rank in Megatron's gradient norm; a sharded one is counted once).
A replicated factor's gradient is a partial sum on each rank (its contraction runs over the sharded dimension):
the factor enters the merge through `copy_to_tensor_model_parallel_region` over the sharding group (identity
forward, all-reduce backward), so every replica gets the full gradient before DDP sees it.

Fused layouts: `linear_qkv` holds, per query group, [q heads, gate heads, k, v] rows; each TP rank owns whole
groups, so the q rows of its groups are the contiguous block `tp_rank` of the HF q_proj rows (likewise gate,
k, v). `linear_fc1` holds [gate_r; up_r]. The merge splits the base into these segments, merges each targeted
segment with its own factors and concatenates them back.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from beamrl.models.beam.lora import init_lora_a, merge_lora_weight
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.trainer.megatron.model import sharding
from beamrl.trainer.megatron.model.moe import BeamExperts

#: Set on every adapter parameter; the HF mapping and `freeze_base` read it.
LORA_ATTR = "is_lora_adapter"


class LoRAMerge(torch.autograd.Function):
    """`merge_lora_weight` forward; gradients to A and B straight through the final rounding.

    w0 [..., out, in] (no gradient), a [..., r, in], b [..., out, r]; leading dims of a may be fewer (a shared A),
    whose gradient then sums over the missing dims."""

    @staticmethod
    def forward(ctx, w0, a, b, scale: float):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        return merge_lora_weight(w0, a, b, scale)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        g = grad.float() * ctx.scale
        grad_a = torch.matmul(b.float().transpose(-1, -2), g)
        while grad_a.dim() > a.dim():
            grad_a = grad_a.sum(0)
        grad_b = torch.matmul(g, a.float().transpose(-1, -2))
        return None, grad_a.to(a.dtype), grad_b.to(b.dtype), None


def _mark(p: torch.nn.Parameter, *, sharded_dim: Optional[int] = None, expert: bool = False) -> torch.nn.Parameter:
    setattr(p, LORA_ATTR, True)
    if sharded_dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, sharded_dim, 1
    if expert:
        p.allreduce = False  # reduced over the expert-data-parallel group, like the expert weights
    return p


def _shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = t.shape[dim] // world
    return t.narrow(dim, rank * size, size).contiguous()


class LoRAFactors(torch.nn.Module):
    """`lora_A` and `lora_B` of one target (shapes as the shard of this rank; see the module docstring)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, *, a_sharded_dim=None, b_sharded_dim=None,
                 expert: bool = False):
        super().__init__()
        self.lora_A = _mark(torch.nn.Parameter(a), sharded_dim=a_sharded_dim, expert=expert)
        self.lora_B = _mark(torch.nn.Parameter(b), sharded_dim=b_sharded_dim, expert=expert)


class _LoRALinearMixin:
    """Replaces the weight handed to Megatron's linear implementation by the merged one."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        return super()._forward_impl(input, self.merged_weight(weight), *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The linear's own state, with each TP-split factor described as split (Megatron would mark the
        submodule's parameters replicated: wrong for a factor that differs per TP rank)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for key, f in self.lora.items():
            for name in ("lora_A", "lora_B"):
                p = getattr(f, name)
                if getattr(p, "tensor_model_parallel", False):
                    k = f"{prefix}lora.{key}.{name}"
                    sd[k] = sharding.tp_sharded(p, k, p.partition_dim, sharded_offsets, metadata)
        return sd


class LoRAColumnParallelLinear(_LoRALinearMixin, ColumnParallelLinear):
    """A column-parallel base whose local rows are `groups` repetitions of `segments` [(target, rows), ...]
    (qkv: per query group [q, gate, k, v]; fc1: one group [gate_r, up_r]); targeted segments get LoRA."""

    def __init__(self, *args, lora: LoRAConfig, layer: int, segments: tuple[tuple[str, int], ...], groups: int,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_scale = lora.scale
        self.segments, self.groups = segments, groups
        dtype = self.weight.dtype
        self.lora = torch.nn.ModuleDict()
        for target, rows in segments:
            if target not in lora.targets:
                continue
            a = init_lora_a((lora.rank, self.input_size), lora.seed, f"{layer}:{target}")
            b = torch.zeros(groups * rows, lora.rank)
            self.lora[_key(target)] = LoRAFactors(a.to(dtype), b.to(dtype), b_sharded_dim=0)

    def merged_weight(self, w0: torch.Tensor) -> torch.Tensor:
        widths = [rows for _, rows in self.segments]
        parts = w0.view(self.groups, sum(widths), w0.shape[-1]).split(widths, dim=1)
        out = []
        for (target, rows), part in zip(self.segments, parts):
            key = _key(target)
            if key in self.lora:
                f = self.lora[key]
                a = copy_to_tensor_model_parallel_region(f.lora_A, group=self.tp_group)
                part = LoRAMerge.apply(part.reshape(-1, part.shape[-1]), a, f.lora_B, self.lora_scale)
            out.append(part.reshape(self.groups, rows, -1))
        return torch.cat(out, dim=1).view(w0.shape) if len(out) > 1 else out[0].view(w0.shape)


class LoRARowParallelLinear(_LoRALinearMixin, RowParallelLinear):
    """A row-parallel base (`linear_proj`, `linear_fc2`) with LoRA on its one target."""

    def __init__(self, *args, lora: LoRAConfig, layer: int, target: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_scale = lora.scale
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        dtype = self.weight.dtype
        a = _shard(init_lora_a((lora.rank, self.input_size), lora.seed, f"{layer}:{target}"), 1, rank, tp)
        b = torch.zeros(self.output_size, lora.rank)
        self.lora = torch.nn.ModuleDict({_key(target): LoRAFactors(a.to(dtype), b.to(dtype), a_sharded_dim=1)})
        self.target = target

    def merged_weight(self, w0: torch.Tensor) -> torch.Tensor:
        f = self.lora[_key(self.target)]
        b = copy_to_tensor_model_parallel_region(f.lora_B, group=self.tp_group)
        return LoRAMerge.apply(w0, f.lora_A, b, self.lora_scale)


class LoRABeamExperts(BeamExperts):
    """`BeamExperts` whose forward uses merged expert weights (gate/up rows of `gate_up_weight`, `down_weight`)."""

    def __init__(self, config, num_local_experts: int, first_expert: int, *, lora: LoRAConfig, layer: int):
        super().__init__(config, num_local_experts, first_expert)
        beam = config.beam
        I, H = beam.moe_intermediate_size, beam.hidden_size
        self.lora_scale = lora.scale
        self.share_a = lora.share_expert_a
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        dtype = self.gate_up_weight.dtype
        shapes = {"mlp.experts.gate_proj": (I, H), "mlp.experts.up_proj": (I, H), "mlp.experts.down_proj": (H, I)}
        self.lora = torch.nn.ModuleDict()
        for target in lora.expert_targets:
            out_f, in_f = shapes[target]
            if lora.share_expert_a:
                if in_f % self.ep_group.size():
                    raise ValueError(f"LoRAConfig.share_expert_a: {target} has {in_f} input features, not divisible "
                                     f"by the expert-parallel size {self.ep_group.size()} (the shared A is EP-sharded)")
                a = _shard(init_lora_a((lora.rank, in_f), lora.seed, f"{layer}:{target}"), 1,
                           self.ep_group.rank(), self.ep_group.size())
            else:
                a = torch.stack([init_lora_a((lora.rank, in_f), lora.seed, f"{layer}:{target}:{first_expert + j}")
                                 for j in range(num_local_experts)])
            b = torch.zeros(num_local_experts, out_f, lora.rank)
            self.lora[_key(target)] = LoRAFactors(a.to(dtype), b.to(dtype), expert=True)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The expert weights (`BeamExperts`) and the factors, split over EP like them: per-expert factors along
        the expert dim, a shared A along its columns."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        ep_rank, ep_size = self.first // self.num_local, self.config.beam.num_experts // self.num_local
        for key, f in self.lora.items():
            for name in ("lora_A", "lora_B"):
                k = f"{prefix}lora.{key}.{name}"
                axis = 1 if (name == "lora_A" and self.share_a) else 0
                sd[k] = sharding.ep_sharded(getattr(f, name), k, sharded_offsets, ep_rank, ep_size, axis=axis)
        return sd

    def _merge(self, w0: torch.Tensor, target: str) -> torch.Tensor:
        key = _key(target)
        if key not in self.lora:
            return w0
        f = self.lora[key]
        a = _gather_columns(f.lora_A, self.ep_group) if self.share_a else f.lora_A
        return LoRAMerge.apply(w0, a, f.lora_B, self.lora_scale)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        I = self.gate_up_weight.shape[1] // 2
        gate = self._merge(self.gate_up_weight[:, :I], "mlp.experts.gate_proj")
        up = self._merge(self.gate_up_weight[:, I:], "mlp.experts.up_proj")
        return torch.cat([gate, up], dim=1), self._merge(self.down_weight, "mlp.experts.down_proj")


def _gather_columns(a_local: torch.Tensor, group) -> torch.Tensor:
    """[r, in/n] shards of the n ranks of `group` -> [r, in] (backward: reduce-scatter, so each rank gets the sum
    over the group of the gradient of its own columns)."""
    if group.size() == 1:
        return a_local
    return gather_from_sequence_parallel_region(a_local.t(), True, group=group).t()


def _key(target: str) -> str:
    """ModuleDict key of a target (dots are not allowed in module names)."""
    return target.replace(".", "_")


# ------------------------------------------------------------------------------------------ spec helpers


def attention_linears(beam, lora: Optional[LoRAConfig], layer: int, tp: int) -> tuple[type, type]:
    """(linear_qkv, linear_proj) builders of one layer's attention."""
    qkv, proj = ColumnParallelLinear, RowParallelLinear
    if lora is None:
        return qkv, proj
    d, qpg = beam.head_dim, beam.num_queries_per_kv
    segments = (("self_attn.q_proj", qpg * d), ("self_attn.gate_proj", qpg * d), ("self_attn.k_proj", d),
                ("self_attn.v_proj", d))
    if any(t in lora.targets for t, _ in segments):
        qkv = functools.partial(LoRAColumnParallelLinear, lora=lora, layer=layer, segments=segments,
                                groups=beam.num_key_value_heads // tp)
    if "self_attn.o_proj" in lora.targets:
        proj = functools.partial(LoRARowParallelLinear, lora=lora, layer=layer, target="self_attn.o_proj")
    return qkv, proj


def dense_mlp_linears(beam, lora: Optional[LoRAConfig], layer: int, tp: int) -> dict:
    """Keyword arguments of `BeamDenseMLP` choosing its linear classes."""
    out = {}
    if lora is None:
        return out
    rows = beam.intermediate_size // tp
    if "mlp.gate_proj" in lora.targets or "mlp.up_proj" in lora.targets:
        out["linear_fc1"] = functools.partial(LoRAColumnParallelLinear, lora=lora, layer=layer,
                                              segments=(("mlp.gate_proj", rows), ("mlp.up_proj", rows)), groups=1)
    if "mlp.down_proj" in lora.targets:
        out["linear_fc2"] = functools.partial(LoRARowParallelLinear, lora=lora, layer=layer, target="mlp.down_proj")
    return out


def moe_experts(lora: Optional[LoRAConfig], layer: int) -> dict:
    """Keyword arguments of `BeamMoELayer` choosing its experts class."""
    if lora is None or not lora.expert_targets:
        return {}
    return {"experts": functools.partial(LoRABeamExperts, lora=lora, layer=layer)}


def freeze_base(model: torch.nn.Module) -> None:
    """Only adapter parameters train: everything else gets `requires_grad=False` (before DDP and the optimizer
    are built, so the base is in neither)."""
    for p in model.parameters():
        p.requires_grad_(bool(getattr(p, LORA_ATTR, False)))


def is_adapter(param: torch.Tensor) -> bool:
    return bool(getattr(param, LORA_ATTR, False))
