"""LoRA adapter parameters <-> full HF-named adapter tensors, for any TP/SP/EP/PP(/VPP) layout (docs/lora.md).

Names are `beamrl.models.beam.lora`'s adapter table (PEFT's names without `base_model.model.`):
`model.layers.{l}.<target module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r]; experts per global expert
id, a shared A without one.

| Megatron module (layer l)                      | factor  | local shard                          |
|------------------------------------------------|---------|--------------------------------------|
| self_attention.linear_qkv.lora.<t>             | lora_A  | replicated                           |
|                                                | lora_B  | rows block tp_rank of the HF B       |
| self_attention.linear_proj.lora.<t>            | lora_A  | columns block tp_rank                |
|                                                | lora_B  | replicated                           |
| mlp.linear_fc1.lora.<t> / mlp.linear_fc2.lora.<t> (dense) | as linear_qkv / linear_proj |        |
| mlp.experts.lora.<t>                           | lora_A  | [E_local, r, in] (or shared [r, in]) |
|                                                | lora_B  | [E_local, out, r], expert e = ep_rank * E_local + j |
| mlp.experts.lora.<t> with share_expert_a       | lora_A  | columns block ep_rank of the shared A |

Export (`export_adapter_tensors`, one unit per layer) is a generator like `mapping.export_hf_tensors`: every rank
must consume it to the end (TP/EP all-gathers and PP broadcasts run per layer in the same order everywhere); full
tensors come out on `dst_rank` only. Import (`load_adapter_tensors`) copies each rank's shards without communication.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from beamrl.models.beam.lora import adapter_tensor_shapes
from beamrl.models.beam.lora_config import ALL_TARGETS, LoRAConfig
from beamrl.models.beam.lora_payload import adapter_layers
from beamrl.trainer.megatron.mapping import MappingError, _Layout, _owner_of_layers, unwrap
from beamrl.trainer.megatron.model.lora import LoRABeamExperts, LoRAColumnParallelLinear, LoRARowParallelLinear
from beamrl.trainer.megatron.model.spec import stage_layers


@dataclass
class _Factor:
    """One adapter parameter and how its local shard relates to the full HF tensor."""

    name: str  # HF adapter name (per-expert factors: the name of expert `first`; see `experts`)
    param: torch.nn.Parameter
    mode: str  # "replicated" | "tp_rows" | "tp_cols" | "experts" | "experts_shared"
    experts: list[str] | None = None  # per local expert j: its HF name (mode "experts")


def lora_config_of(model_chunks) -> LoRAConfig:
    chunks = _chunks(model_chunks)
    lora = chunks[0].config.lora
    if lora is None:
        raise MappingError("the model has no LoRA adapters (TrainerConfig.lora is None)")
    return lora


def _chunks(model_chunks) -> list:
    return [unwrap(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]


def _layer_factors(layer_module, layer: int, lay: _Layout, lora: LoRAConfig) -> list[_Factor]:
    """The adapter factors of one decoder layer module (global layer id `layer`)."""
    p = f"model.layers.{layer}."
    out: list[_Factor] = []
    attn = layer_module.self_attention
    mlp = layer_module.mlp
    for module in (attn.linear_qkv, attn.linear_proj, getattr(mlp, "linear_fc1", None),
                   getattr(mlp, "linear_fc2", None)):
        if isinstance(module, (LoRAColumnParallelLinear, LoRARowParallelLinear)):
            column = isinstance(module, LoRAColumnParallelLinear)
            for key, f in module.lora.items():
                target = _target(key)
                a, b = p + target + ".lora_A.weight", p + target + ".lora_B.weight"
                out.append(_Factor(a, f.lora_A, "replicated" if column else "tp_cols"))
                out.append(_Factor(b, f.lora_B, "tp_rows" if column else "replicated"))
    experts = getattr(mlp, "experts", None)
    if isinstance(experts, LoRABeamExperts):
        for key, f in experts.lora.items():
            target = _target(key)
            proj = target.rsplit(".", 1)[1]
            names = lambda kind: [f"{p}mlp.experts.{experts.first + j}.{proj}.lora_{kind}.weight"  # noqa: E731
                                  for j in range(experts.num_local)]
            if lora.share_expert_a:
                out.append(_Factor(f"{p}mlp.experts.{proj}.lora_A.weight", f.lora_A, "experts_shared"))
            else:
                out.append(_Factor(names("A")[0], f.lora_A, "experts", names("A")))
            out.append(_Factor(names("B")[0], f.lora_B, "experts", names("B")))
    return out


_TARGET_OF_KEY = {t.replace(".", "_"): t for t in ALL_TARGETS}


def _target(key: str) -> str:
    """The target of a LoRA ModuleDict key (`model/lora.py` replaces the dots)."""
    if key not in _TARGET_OF_KEY:
        raise MappingError(f"unknown LoRA module key {key!r}")
    return _TARGET_OF_KEY[key]


def _stage_factors(chunk, v: int, lay: _Layout, lora: LoRAConfig) -> dict[int, list[_Factor]]:
    cfg = chunk.config
    layers = list(stage_layers(cfg, vp_stage=v if cfg.virtual_pipeline_model_parallel_size else None,
                               pp_rank=lay.pp_rank))
    return {layer: _layer_factors(chunk.decoder.layers[i], layer, lay, lora) for i, layer in enumerate(layers)}


# ------------------------------------------------------------------------------------------------- import


def load_adapter_tensors(model_chunks: Sequence, tensors: Mapping[str, torch.Tensor], *, strict: bool = True) -> int:
    """Copy this rank's shards of full HF-named adapter tensors into the adapter parameters (in place, no grad).

    strict: every adapter parameter must be given, and every given name must be an adapter tensor of this model
    (MappingError names the first offender). Returns the number of parameters filled."""
    chunks = _chunks(model_chunks)
    lora = lora_config_of(chunks)
    expected = adapter_tensor_shapes(chunks[0].config.beam, lora)
    unknown = [n for n in tensors if n not in expected]
    if strict and unknown:
        raise MappingError(f"{unknown[0]!r} is not an adapter tensor of this model/LoRAConfig")
    lay = _Layout.current()
    filled = 0
    for v, chunk in enumerate(chunks):
        for factors in _stage_factors(chunk, v, lay, lora).values():
            for f in factors:
                names = f.experts if f.mode == "experts" else [f.name]
                missing = [n for n in names if n not in tensors]
                if missing:
                    if strict:
                        raise MappingError(f"adapter tensor {missing[0]!r} is missing")
                    continue
                for n in names:
                    if tuple(tensors[n].shape) != tuple(expected[n]):
                        raise MappingError(f"adapter tensor {n!r} has shape {tuple(tensors[n].shape)}, expected "
                                           f"{tuple(expected[n])}")
                src = _local_shard(f, tensors, lay)
                with torch.no_grad():
                    f.param.copy_(src)
                filled += 1
    return filled


def _local_shard(f: _Factor, tensors, lay: _Layout) -> torch.Tensor:
    if f.mode == "experts":
        return torch.stack([tensors[n] for n in f.experts])
    t = tensors[f.name]
    if f.mode == "tp_rows":
        return t.narrow(0, lay.tp_rank * (t.shape[0] // lay.tp), t.shape[0] // lay.tp)
    if f.mode == "tp_cols":
        return t.narrow(1, lay.tp_rank * (t.shape[1] // lay.tp), t.shape[1] // lay.tp)
    if f.mode == "experts_shared":
        return t.narrow(1, lay.ep_rank * (t.shape[1] // lay.ep), t.shape[1] // lay.ep)
    return t


# ------------------------------------------------------------------------------------------------- export


def export_adapter_tensors(model_chunks: Sequence, *, dst_rank: int = 0,
                           source: str = "param") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream the full HF-named adapter tensors, one list per layer (`export_adapter_layout` gives the same units
    without data; no size budget: bucketing is the weight sync's job), on `dst_rank` (other ranks get empty lists
    and must keep iterating). Collective over the whole world.

    source: "param" (the adapter weights) or "main_grad" (their gradients after `forward_backward`, in the
    parameter dtype; needs a non-distributed optimizer, whose main_grad holds the full reduced gradient)."""
    chunks = _chunks(model_chunks)
    lora = lora_config_of(chunks)
    beam = chunks[0].config.beam
    lay = _Layout.current()
    owner = _owner_of_layers(chunks[0].config)
    mine: dict[int, list[_Factor]] = {}
    for v, chunk in enumerate(chunks):
        mine.update(_stage_factors(chunk, v, lay, lora))
    shapes = adapter_tensor_shapes(beam, lora)
    dtype = chunks[0].config.params_dtype
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    for layer, names in sorted(adapter_layers(beam, lora).items()):
        stage = owner[layer][0]
        produced = _gather_layer(mine[layer], lay, source) if stage == lay.pp_rank else None
        tensors = []
        for name in names:
            if lay.pp == 1:
                tensors.append((name, produced[name]))
                continue
            t = produced[name].contiguous() if produced is not None else torch.empty(shapes[name], dtype=dtype)
            dist.broadcast(t, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            tensors.append((name, t))
        yield tensors if dist.get_rank() == dst_rank else []


def export_adapter_layout(model_chunks: Sequence) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """(name, shape, dtype) of every tensor `export_adapter_tensors` yields, per unit (layer) and in the same
    order; the same on every rank, without communication."""
    chunks = _chunks(model_chunks)
    lora = lora_config_of(chunks)
    beam = chunks[0].config.beam
    shapes = adapter_tensor_shapes(beam, lora)
    dtype = chunks[0].config.params_dtype
    return [[(n, tuple(shapes[n]), dtype) for n in names] for _, names in sorted(adapter_layers(beam, lora).items())]


def _value(f: _Factor, source: str) -> torch.Tensor:
    if source == "param":
        return f.param.detach()
    if source != "main_grad":
        raise ValueError(f"source must be 'param' or 'main_grad', got {source!r}")
    grad = getattr(f.param, "main_grad", None)
    if grad is None:
        return torch.zeros_like(f.param)
    return grad.detach().to(f.param.dtype).view_as(f.param)


def _all_gather(t: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    if world == 1:
        return [t.clone()]
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _gather_layer(factors: list[_Factor], lay: _Layout, source: str) -> dict[str, torch.Tensor]:
    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    out: dict[str, torch.Tensor] = {}
    for f in factors:
        t = _value(f, source)
        if f.mode == "replicated":
            out[f.name] = t.clone()
        elif f.mode == "experts_shared":
            out[f.name] = torch.cat(_all_gather(t, ep_group, lay.ep), dim=1)
        elif f.mode == "tp_rows":
            out[f.name] = torch.cat(_all_gather(t, tp_group, lay.tp), dim=0)
        elif f.mode == "tp_cols":
            out[f.name] = torch.cat(_all_gather(t, tp_group, lay.tp), dim=1)
        else:  # experts: gather every EP rank's [E_local, ...] stack; name each global expert
            stacks = _all_gather(t, ep_group, lay.ep)
            e_local = t.shape[0]
            template = f.experts[0]
            first = int(template.split(".mlp.experts.")[1].split(".")[0])
            for r, stack in enumerate(stacks):
                for j in range(e_local):
                    e = r * e_local + j
                    out[template.replace(f".mlp.experts.{first}.", f".mlp.experts.{e}.", 1)] = stack[j].clone()
    return out


@contextmanager
def merged_base_weights(model_chunks: Sequence) -> Iterator[None]:
    """Inside the block, every adapted base parameter holds the merged W' its forward uses (so
    `mapping.export_hf_tensors` exports what the trainer computes with); W0 is put back on exit. For tests and
    parity checks (it costs one merged copy of every adapted weight)."""
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for chunk in _chunks(model_chunks):
                for m in chunk.modules():
                    if isinstance(m, (LoRAColumnParallelLinear, LoRARowParallelLinear)):
                        merged = [(m.weight, m.merged_weight(m.weight.data).detach())]
                    elif isinstance(m, LoRABeamExperts):
                        gate_up, down = m.expert_weights()
                        merged = [(m.gate_up_weight, gate_up.detach()), (m.down_weight, down.detach())]
                    else:
                        continue
                    for p, w in merged:
                        swapped.append((p, p.data))
                        p.data = w
        yield
    finally:
        for p, data in reversed(swapped):
            p.data = data
