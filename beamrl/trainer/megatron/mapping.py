"""Beam HF <-> Megatron weight mapping for any TP/SP/EP/PP(/VPP) layout (docs/trainer.md "Weight mapping").

Import: `load_hf_weights(model_chunks, hf_state)` — every rank copies *its own shards* straight from the
HF-named tensors (a dict, or any Mapping such as a lazy safetensors view; per-expert names as returned by
`beamrl.models.beam.checkpoint.load_checkpoint`). No communication.

Export: `export_hf_tensors(model_chunks)` — a generator that yields, per export unit (embedding, a layer's
attention, its router, one expert slot over EP, ...), `list[(hf_name, tensor)]` of full HF tensors on `dst_rank`
(global rank 0 by default) and empty lists on every other rank; `export_hf_layout(model_chunks)` gives the same
units' names, shapes and dtypes without communication. **Every rank must consume the export to the end** (it
issues TP/EP all-gathers and PP broadcasts in the same order on all ranks). Router weight and correction bias stay
FP32; everything else has the model dtype. There is no size budget: the weight sync alone buckets the stream
(`beamrl.sync.plan`). This is the source of weight sync and of save_pretrained.

Megatron-side layout (local spec, this package's modules), for global layer l on its (stage, chunk):
| Megatron (chunk-local layer i)                         | HF (model.layers.l.)                 | shard            |
| embedding.word_embeddings.weight                       | model.embed_tokens.weight            | vocab rows / TP  |
| decoder.layers.i.input_layernorm.weight                | input_layernorm.weight               | replicated       |
| decoder.layers.i.self_attention.linear_qkv.weight      | per KV group [q_g; gate_g; k_g; v_g] | groups / TP      |
| decoder.layers.i.self_attention.{q,k}_layernorm.weight | self_attn.{q,k}_norm.weight          | replicated       |
| decoder.layers.i.self_attention.gate_bias              | self_attn.gate_bias                  | heads / TP       |
| decoder.layers.i.self_attention.linear_proj.weight     | self_attn.o_proj.weight              | columns / TP     |
| decoder.layers.i.post_self_attn_layernorm.weight       | post_attention_layernorm.weight      | replicated       |
| decoder.layers.i.pre_mlp_layernorm.weight              | pre_feedforward_layernorm.weight     | replicated       |
| decoder.layers.i.mlp.linear_fc1.weight (dense)         | [gate_proj_r; up_proj_r] per TP rank | rows / TP        |
| decoder.layers.i.mlp.linear_fc2.weight (dense)         | mlp.down_proj.weight                 | columns / TP     |
| decoder.layers.i.mlp.router.weight (FP32)              | mlp.gate.weight                      | replicated       |
| decoder.layers.i.mlp.router.expert_bias (FP32 buffer)  | mlp.gate.e_score_correction_bias     | replicated       |
| decoder.layers.i.mlp.experts.gate_up_weight[j]         | mlp.experts.{e}.[gate_proj; up_proj] | experts / EP     |
| decoder.layers.i.mlp.experts.down_weight[j]            | mlp.experts.{e}.down_proj.weight     | experts / EP     |
| decoder.layers.i.post_mlp_layernorm.weight             | post_feedforward_layernorm.weight    | replicated       |
| decoder.final_layernorm.weight                         | model.norm.weight                    | replicated       |
| output_layer.weight                                    | lm_head.weight                       | vocab rows / TP  |
(e = ep_rank * E_local + j.)

LoRA: adapter parameters are not HF weights; they are skipped here (this mapping moves the frozen base W0) and
mapped by `lora_mapping.py` to PEFT-style adapter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.weights import expected_tensors
from beamrl.trainer.megatron.model.provider import BeamGPTModel
from beamrl.trainer.megatron.model.spec import stage_layers


class MappingError(ValueError):
    """An HF tensor is missing or has the wrong shape for the Megatron parameter it feeds (names both)."""


# ------------------------------------------------------------------------------------------------ helpers


def unwrap(chunk) -> BeamGPTModel:
    """The `BeamGPTModel` inside DDP / Float16Module wrappers."""
    m = chunk
    while not isinstance(m, BeamGPTModel):
        if not hasattr(m, "module"):
            raise TypeError(f"model chunk {type(chunk).__name__} does not wrap a BeamGPTModel")
        m = m.module
    return m


@dataclass(frozen=True)
class _Layout:
    tp: int
    tp_rank: int
    ep: int
    ep_rank: int
    pp: int
    pp_rank: int
    vpp: int

    @classmethod
    def current(cls) -> "_Layout":
        ps = parallel_state
        return cls(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                   ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                   ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                   ps.get_virtual_pipeline_model_parallel_world_size() or 1)


def _owner_of_layers(config) -> dict[int, tuple[int, int, int]]:
    """global layer -> (pp_rank, vp_stage, local index) for every layer of the model."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    out = {}
    for p in range(pp):
        for v in range(vpp or 1):
            for i, layer in enumerate(stage_layers(config, vp_stage=v if vpp else None, pp_rank=p)):
                out[layer] = (p, v, i)
    return out


def _shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    n = t.shape[dim]
    if n % world:
        raise MappingError(f"dimension {dim} of size {n} does not split over {world} ranks")
    size = n // world
    return t.narrow(dim, rank * size, size)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)`, without the copy when there is one part (TP 1: the export reads it before the weights
    change again)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _qkv_rows(config: BeamConfig, q, g, k, v, groups: range) -> torch.Tensor:
    d, qpg = config.head_dim, config.num_queries_per_kv
    parts = []
    for grp in groups:
        parts += [q[grp * qpg * d:(grp + 1) * qpg * d], g[grp * qpg * d:(grp + 1) * qpg * d],
                  k[grp * d:(grp + 1) * d], v[grp * d:(grp + 1) * d]]
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------------- import


def load_hf_weights(model_chunks: Sequence, hf_state: Mapping[str, torch.Tensor], *, strict: bool = True) -> int:
    """Copy this rank's shards of the HF tensors into the model chunks (in place, under no_grad).

    model_chunks: this rank's chunks in VPP order (a single model or a list). Returns the number of Megatron
    tensors filled. strict: every Megatron tensor must be found (MappingError names the HF tensor otherwise).
    Load before the optimizer copies FP32 main params (or reload them afterwards)."""
    chunks = [unwrap(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    lay = _Layout.current()
    filled = 0
    for v, chunk in enumerate(chunks):
        cfg = chunk.config
        beam = cfg.beam
        layers = list(stage_layers(cfg, vp_stage=v if cfg.virtual_pipeline_model_parallel_size else None,
                                   pp_rank=lay.pp_rank))
        for name, dst in _TensorRefs(chunk).items():
            src = _source_for(beam, name, layers, lay, hf_state, strict)
            if src is None:
                continue
            if tuple(src.shape) != tuple(dst.shape):
                raise MappingError(f"{name}: built {tuple(src.shape)} from HF tensors but the Megatron tensor is "
                                   f"{tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src)
            filled += 1
    return filled


def _get(hf_state, name: str, strict: bool):
    if name in hf_state:
        return hf_state[name]
    if strict:
        raise MappingError(f"HF tensor {name!r} is missing (needed by the Megatron model)")
    return None


def _source_for(c: BeamConfig, name: str, layers: list, lay: _Layout, hf, strict: bool) -> Optional[torch.Tensor]:
    tp, r = lay.tp, lay.tp_rank
    if name == "embedding.word_embeddings.weight":
        t = _get(hf, "model.embed_tokens.weight", strict)
        return None if t is None else _shard(t, 0, r, tp)
    if name == "output_layer.weight":
        t = _get(hf, "lm_head.weight", strict)
        return None if t is None else _shard(t, 0, r, tp)
    if name == "decoder.final_layernorm.weight":
        return _get(hf, "model.norm.weight", strict)
    if not name.startswith("decoder.layers."):
        raise MappingError(f"Megatron tensor {name!r} has no HF mapping")
    local, rest = name[len("decoder.layers."):].split(".", 1)
    layer = layers[int(local)]
    p = f"model.layers.{layer}."
    simple = {"input_layernorm.weight": "input_layernorm.weight",
              "post_self_attn_layernorm.weight": "post_attention_layernorm.weight",
              "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
              "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight",
              "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
              "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
              "mlp.router.weight": "mlp.gate.weight",
              "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}
    if rest in simple:
        return _get(hf, p + simple[rest], strict)
    if rest == "self_attention.gate_bias":
        t = _get(hf, p + "self_attn.gate_bias", strict)
        return None if t is None else _shard(t, 0, r, tp)
    if rest == "self_attention.linear_proj.weight":
        t = _get(hf, p + "self_attn.o_proj.weight", strict)
        return None if t is None else _shard(t, 1, r, tp)
    if rest == "self_attention.linear_qkv.weight":
        parts = [_get(hf, p + f"self_attn.{n}_proj.weight", strict) for n in ("q", "gate", "k", "v")]
        if any(t is None for t in parts):
            return None
        q, g, k, v = parts
        per = c.num_key_value_heads // tp
        return _qkv_rows(c, q, g, k, v, range(r * per, (r + 1) * per))
    if rest == "mlp.linear_fc1.weight":
        gate, up = _get(hf, p + "mlp.gate_proj.weight", strict), _get(hf, p + "mlp.up_proj.weight", strict)
        if gate is None or up is None:
            return None
        return torch.cat([_shard(gate, 0, r, tp), _shard(up, 0, r, tp)])
    if rest == "mlp.linear_fc2.weight":
        t = _get(hf, p + "mlp.down_proj.weight", strict)
        return None if t is None else _shard(t, 1, r, tp)
    if rest in ("mlp.experts.gate_up_weight", "mlp.experts.down_weight"):
        e_local = c.num_experts // lay.ep
        out = []
        for j in range(e_local):
            e = lay.ep_rank * e_local + j
            ep = p + f"mlp.experts.{e}."
            if rest.endswith("gate_up_weight"):
                g, u = _get(hf, ep + "gate_proj.weight", strict), _get(hf, ep + "up_proj.weight", strict)
                if g is None or u is None:
                    return None
                out.append(torch.cat([g, u]))
            else:
                d = _get(hf, ep + "down_proj.weight", strict)
                if d is None:
                    return None
                out.append(d)
        return torch.stack(out)
    raise MappingError(f"Megatron tensor {name!r} has no HF mapping")


# ------------------------------------------------------------------------------------------------- export


def export_hf_tensors(model_chunks: Sequence, *, dst_rank: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream full HF-named tensors, one list per export unit (`export_hf_layout` gives the same units without
    data); no size budget: bucketing is the weight sync's job. Yields on `dst_rank` only (other ranks get empty
    lists and must keep iterating). Tensors are CPU-resident only if the model is; FP32 router/bias kept.
    A caller that exports the same chunks again and again (the trainer: every weight sync) keeps an `HFExporter`."""
    yield from HFExporter(model_chunks, dst_rank).stream()


def export_hf_layout(model_chunks: Sequence) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """(name, shape, dtype) of every tensor `export_hf_tensors` yields, per unit and in the same order; the same on
    every rank, and no communication (the weight sync's manifest is built from it before the export runs)."""
    return HFExporter(model_chunks, dst_rank=0).layout()


class _TensorRefs:
    """A chunk's base tensors by Megatron name (what the HF mapping loads and exports), looked up when read. Each
    name is kept as (module, attribute), so a parameter whose `.data` was swapped (`hf_gradients`, LoRA's
    `merged_base_weights`), a reassigned buffer or a storage released and resumed (trainer sleep) is read as it is
    now, never as it was when the table was made. LoRA adapter parameters are left out (`lora_mapping.py` maps
    them)."""

    def __init__(self, chunk: BeamGPTModel) -> None:
        self._where: dict[str, tuple[torch.nn.Module, str]] = {}
        for prefix, module in chunk.named_modules():
            dot = prefix + "." if prefix else ""
            for attr, p in module._parameters.items():
                if p is not None and not getattr(p, "is_lora_adapter", False):
                    self._where.setdefault(dot + attr, (module, attr))
            for attr, b in module._buffers.items():
                if b is not None:
                    self._where.setdefault(dot + attr, (module, attr))

    def __getitem__(self, name: str) -> torch.Tensor:
        module, attr = self._where[name]
        return getattr(module, attr)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (Megatron name, tensor as it is now)."""
        return ((name, getattr(module, attr)) for name, (module, attr) in self._where.items())


class HFExporter:
    """The HF export of fixed model chunks at the current parallel layout: per unit, gather TP/EP shards on the
    owning stage, broadcast over PP (module docstring, "Export").

    What does not change between exports is worked out once: the units, their layouts (names, shapes, dtypes), the
    stage owning each layer, where each Megatron tensor lives (`_TensorRefs`). `stream()` reads every tensor when
    it runs, so one exporter serves every weight sync of a trainer (`MegatronTrainer.export_hf`); build a new one
    for other chunks or another parallel layout."""

    def __init__(self, model_chunks: Sequence, dst_rank: int = 0):
        chunks = [unwrap(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
        self.chunks = chunks
        self.cfg = chunks[0].config
        self.beam: BeamConfig = self.cfg.beam
        self.lay = _Layout.current()
        self.dst = dst_rank
        self.owner = _owner_of_layers(self.cfg)
        self.specs = expected_tensors(self.beam)
        self.dtype = self.cfg.params_dtype
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.named = [_TensorRefs(c) for c in chunks]
        self._units = tuple(self._unit_order())
        self._expert_views: dict[int, tuple] = {}  # EP 1: the current layer's expert views (`_local_experts`)
        self._layouts = {unit: self._unit_layout(unit) for unit in self._units}

    def units(self) -> tuple:
        """The export units in order: (kind, layer, expert slot)."""
        return self._units

    def layout(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """`export_hf_layout`: (name, shape, dtype) per tensor, per unit."""
        return [[(n, tuple(shape), dtype) for n, shape, dtype in self._layouts[unit]] for unit in self._units]

    def stream(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`export_hf_tensors`: every rank must iterate to the end (collectives); tensors on `dst_rank` only."""
        mine = dist.get_rank() == self.dst
        self._expert_views.clear()  # an export abandoned mid-layer leaves nothing for this one
        for unit in self._units:
            tensors = self.run(unit)
            yield tensors if mine else []

    def _unit_order(self):
        c = self.beam
        yield ("embed", None, None)
        for layer in range(c.num_hidden_layers):
            yield ("attn", layer, None)
            if c.is_moe(layer):
                yield ("router", layer, None)
                for j in range(c.num_experts // self.lay.ep):
                    yield ("experts", layer, j)
            else:
                yield ("dense", layer, None)
        yield ("final", None, None)

    def _stage_of(self, kind, layer) -> tuple[int, int, Optional[int]]:
        if kind == "embed":
            return 0, 0, None
        if kind == "final":
            return self.lay.pp - 1, self.lay.vpp - 1, None
        return self.owner[layer]

    def run(self, unit) -> list[tuple[str, torch.Tensor]]:
        kind, layer, j = unit
        stage, vchunk, local = self._stage_of(kind, layer)
        if stage == self.lay.pp_rank:
            named = self.named[vchunk]
            produced = getattr(self, "_" + kind)(named, layer, local, j)
        else:
            produced = None
        if self.lay.pp == 1:
            return produced
        return self._broadcast_from_stage(produced, unit, stage)

    def unit_layout(self, unit) -> list[tuple[str, tuple, torch.dtype]]:
        """What a unit produces, in the order `run` returns it, known on every rank (PP receivers, sync layout)."""
        return self._layouts[unit]

    def _unit_layout(self, unit) -> list[tuple[str, tuple, torch.dtype]]:
        kind, layer, j = unit
        c = self.beam
        if kind == "embed":
            names = ["model.embed_tokens.weight"]
        elif kind == "final":
            names = ["model.norm.weight", "lm_head.weight"]
        else:
            p = f"model.layers.{layer}."
            if kind == "attn":
                names = [p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                         "self_attn.gate_proj.weight", "self_attn.o_proj.weight",
                                         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.gate_bias",
                                         "input_layernorm.weight", "post_attention_layernorm.weight",
                                         "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")]
            elif kind == "dense":
                names = [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            elif kind == "router":
                names = [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"]
            else:
                e_local = c.num_experts // self.lay.ep
                names = [p + f"mlp.experts.{r * e_local + j}.{n}_proj.weight"
                         for r in range(self.lay.ep) for n in ("gate", "up", "down")]
        return [(n, self.specs[n].shape, self.specs[n].dtype(self.dtype)) for n in names]

    def _broadcast_from_stage(self, produced, unit, stage):
        src = dist.get_global_rank(self.pp_group, stage)
        out = []
        expected = self.unit_layout(unit)
        by_name = dict(produced) if produced is not None else {}
        for name, shape, dtype in expected:
            t = by_name[name].contiguous() if produced is not None else torch.empty(shape, dtype=dtype)
            dist.broadcast(t, src=src, group=self.pp_group)
            out.append((name, t))
        return out

    # -- gathers
    # No copies where no gather is needed: the export's consumer (the weight sync's packing, a checkpoint writer)
    # reads the tensors before the weights change again.
    def _tp_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.lay.tp == 1:
            return t.detach()
        parts = [torch.empty_like(t) for _ in range(self.lay.tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def _tp_parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.lay.tp == 1:
            return [t.detach()]
        parts = [torch.empty_like(t) for _ in range(self.lay.tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.tp_group)
        return parts

    # -- units
    def _embed(self, named, layer, local, j):
        return [("model.embed_tokens.weight", self._tp_cat(named["embedding.word_embeddings.weight"], 0))]

    def _final(self, named, layer, local, j):
        return [("model.norm.weight", named["decoder.final_layernorm.weight"].detach()),
                ("lm_head.weight", self._tp_cat(named["output_layer.weight"], 0))]

    def _attn(self, named, layer, local, j):
        c = self.beam
        m, p = f"decoder.layers.{local}.", f"model.layers.{layer}."
        d, qpg = c.head_dim, c.num_queries_per_kv
        packed = _cat(self._tp_parts(named[m + "self_attention.linear_qkv.weight"]))
        per_group = packed.view(c.num_key_value_heads, (2 * qpg + 2) * d, c.hidden_size)
        q = per_group[:, :qpg * d].reshape(-1, c.hidden_size)
        g = per_group[:, qpg * d:2 * qpg * d].reshape(-1, c.hidden_size)
        k = per_group[:, 2 * qpg * d:(2 * qpg + 1) * d].reshape(-1, c.hidden_size)
        v = per_group[:, (2 * qpg + 1) * d:].reshape(-1, c.hidden_size)
        a = p + "self_attn."
        return [(a + "q_proj.weight", q.contiguous()), (a + "k_proj.weight", k.contiguous()),
                (a + "v_proj.weight", v.contiguous()), (a + "gate_proj.weight", g.contiguous()),
                (a + "o_proj.weight", self._tp_cat(named[m + "self_attention.linear_proj.weight"], 1)),
                (a + "q_norm.weight", named[m + "self_attention.q_layernorm.weight"].detach()),
                (a + "k_norm.weight", named[m + "self_attention.k_layernorm.weight"].detach()),
                (a + "gate_bias", self._tp_cat(named[m + "self_attention.gate_bias"], 0)),
                (p + "input_layernorm.weight", named[m + "input_layernorm.weight"].detach()),
                (p + "post_attention_layernorm.weight", named[m + "post_self_attn_layernorm.weight"].detach()),
                (p + "pre_feedforward_layernorm.weight", named[m + "pre_mlp_layernorm.weight"].detach()),
                (p + "post_feedforward_layernorm.weight", named[m + "post_mlp_layernorm.weight"].detach())]

    def _dense(self, named, layer, local, j):
        m, p = f"decoder.layers.{local}.mlp.", f"model.layers.{layer}.mlp."
        parts = self._tp_parts(named[m + "linear_fc1.weight"])
        gate = _cat([t.chunk(2)[0] for t in parts])
        up = _cat([t.chunk(2)[1] for t in parts])
        return [(p + "gate_proj.weight", gate), (p + "up_proj.weight", up),
                (p + "down_proj.weight", self._tp_cat(named[m + "linear_fc2.weight"], 1))]

    def _router(self, named, layer, local, j):
        m, p = f"decoder.layers.{local}.mlp.router.", f"model.layers.{layer}.mlp.gate."
        return [(p + "weight", named[m + "weight"].detach().float()),
                (p + "e_score_correction_bias", named[m + "expert_bias"].detach().float())]

    def _experts(self, named, layer, local, j):
        m = f"decoder.layers.{local}.mlp.experts."
        inter = self.beam.moe_intermediate_size
        names = self._layouts[("experts", layer, j)]  # per EP rank r: expert r * E_local + j's gate, up, down
        if self.lay.ep == 1:
            gate, up, down = self._local_experts(named, m, layer, j, inter)
            return [(names[0][0], gate[j].contiguous()), (names[1][0], up[j].contiguous()),
                    (names[2][0], down[j].contiguous())]
        # Detached before indexing: indexing a parameter would record an autograd node per expert and export.
        gu = named[m + "gate_up_weight"].detach()[j].contiguous()
        dn = named[m + "down_weight"].detach()[j].contiguous()
        gus = [torch.empty_like(gu) for _ in range(self.lay.ep)]
        dns = [torch.empty_like(dn) for _ in range(self.lay.ep)]
        dist.all_gather(gus, gu, group=self.ep_group)
        dist.all_gather(dns, dn, group=self.ep_group)
        out = []
        for r in range(self.lay.ep):
            gate, up, down = names[3 * r][0], names[3 * r + 1][0], names[3 * r + 2][0]
            out += [(gate, gus[r][:inter].contiguous()), (up, gus[r][inter:].contiguous()), (down, dns[r])]
        return out

    def _local_experts(self, named, m: str, layer: int, j: int, inter: int) -> tuple:
        """EP 1: (gate, up, down) views of every expert of `layer`, made at its first slot (three calls for the
        layer instead of a handful of tensor ops per expert) and dropped after its last; never kept from one export
        to the next (the weights, or a parameter's `.data`, change in between). On the quickstart's tiny Beam it saves
        ~1.5 ms per export: 0.9 vs 2.4 and 2.1 vs 3.6 ms in two sittings (docs/benchmarks.md, ninth session)."""
        views = self._expert_views.get(layer)
        if views is None or j == 0:
            gu, dn = named[m + "gate_up_weight"].detach(), named[m + "down_weight"].detach()
            views = self._expert_views[layer] = (gu[:, :inter].unbind(0), gu[:, inter:].unbind(0), dn.unbind(0))
        if j == len(views[2]) - 1:
            del self._expert_views[layer]
        return views
