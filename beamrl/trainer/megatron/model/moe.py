"""Beam's MoE layer: FP32 DeepSeek-V3 grouped sigmoid router, routed experts with SGLang's combine order, and
routing replay (R3) / routing record.

Why not Megatron's `MoELayer`: stock experts apply the routing probabilities *before* fc2 and the router applies
the 2.5 scale; SGLang applies the FP32 weight to the down GEMM's FP32 accumulator, rounds each expert output to
BF16, and applies 2.5 once at the combine (beam-numerics §3.10.7-8). Stock also casts the router weight to
params_dtype (router.py:81). This module owns all three.

Token exchange (EP > 1), `config.moe_token_dispatcher_type`:
- "alltoall" (the bridge's default): every (token, slot) pair is sent to its expert's EP rank, the BF16 expert
  output comes back, and the combine runs on the token's rank in slot order — SGLang's exact combine.
- "allgather": every EP rank gathers the tokens, ids and weights of the group (padded to the group's longest
  microbatch), runs its local experts, and the FP32 partial sums (each the sum of the rank's BF16-rounded `y_k`)
  are reduce-scattered back; `bf16(2.5 * sum)` runs on the token's rank. The FP32 sum order differs from
  SGLang's slot order across ranks (last-bit FP32 differences; exact in float32 tests).
EP ranks may hold microbatches of different lengths. With EP = 1 the whole computation is
`beamrl.kernels.ops.grouped_experts` (slot-order combine); with EP > 1 the local experts run eagerly, or as two
`torch._grouped_mm` GEMMs with fused kernels (`BeamExperts.pair_outputs`). Only etp = 1 is supported.

Parameter layout (packed, per local expert e = global id - ep_rank * E_local):
- `router.weight` FP32 [E, H] (kept FP32 through `.bfloat16()` / `.to(dtype)`; flagged `sequence_parallel`
  under SP so its grad is summed over TP);
- `router.expert_bias` FP32 [E] buffer (`e_score_correction_bias`; frozen: selection only, synced as a weight);
- `experts.gate_up_weight` [E_local, 2I, H] (gate rows, then up rows) and `experts.down_weight` [E_local, H, I],
  both flagged `allreduce=False` so Megatron's DDP reduces them over the expert-data-parallel group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule

from beamrl.kernels import ops
from beamrl.models.beam import numerics
from beamrl.trainer.megatron.model import sharding


class _KeepFp32(torch.nn.Module):
    """A module whose floating tensors stay FP32 through `.half()/.bfloat16()/.to(dtype)` (device moves apply)."""

    def _apply(self, fn, recurse=True):
        saved = {n: t.data for n, t in list(self._parameters.items()) + list(self._buffers.items()) if t is not None}
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = getattr(self, name)
            if new.dtype != torch.float32:  # undo a dtype cast from the original FP32 data (no precision loss)
                new.data = old.to(device=new.device)
        return self


class BeamRouter(_KeepFp32, MegatronModule):
    """FP32 logits + grouped sigmoid top-k (`ops.route`); optional forced ids per token (replay)."""

    def __init__(self, config):
        MegatronModule.__init__(self, config=config)
        beam = config.beam
        self.top_k, self.n_group, self.topk_group = beam.num_experts_per_tok, beam.n_group, beam.topk_group
        self.weight = torch.nn.Parameter(torch.empty(beam.num_experts, beam.hidden_size, dtype=torch.float32))
        config.init_method(self.weight.data)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))
        self.register_buffer("expert_bias", torch.zeros(beam.num_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor, forced_ids: Optional[torch.Tensor] = None):
        """x [T, H]; forced_ids int [T, k] or None; rows of forced_ids with any -1 route freely.
        Returns (weights FP32 [T, k], ids int64 [T, k])."""
        backend = self.config.kernel_backend
        args = (self.weight, self.expert_bias, self.top_k, self.n_group, self.topk_group)
        if forced_ids is None:
            return ops.route(x, *args, backend=backend)
        forced_ids = forced_ids.to(device=x.device, dtype=torch.int64)
        free = (forced_ids < 0).any(dim=-1)
        if bool(free.any()):
            with torch.no_grad():
                _, natural = ops.route(x.detach(), *args, backend=backend)
            forced_ids = torch.where(free.unsqueeze(-1), natural, forced_ids)
        return ops.route(x, *args, forced_ids=forced_ids, backend=backend)


class BeamExperts(MegatronModule):
    """This EP rank's experts, packed: gate_up_weight [E_local, 2I, H], down_weight [E_local, H, I]."""

    def __init__(self, config, num_local_experts: int, first_expert: int):
        super().__init__(config=config)
        beam = config.beam
        self.num_local, self.first = num_local_experts, first_expert
        I, H = beam.moe_intermediate_size, beam.hidden_size
        self.gate_up_weight = torch.nn.Parameter(torch.empty(num_local_experts, 2 * I, H, dtype=config.params_dtype))
        self.down_weight = torch.nn.Parameter(torch.empty(num_local_experts, H, I, dtype=config.params_dtype))
        for p, init in ((self.gate_up_weight, config.init_method), (self.down_weight, config.output_layer_init_method)):
            init(p.data)
            setattr(p, "allreduce", False)  # expert-parallel param: reduced over the expert-DP group

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E_local, 2I, H], down [E_local, H, I]) as the forward uses them (LoRA merges here)."""
        return self.gate_up_weight, self.down_weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Both weights split over EP along dim 0 (global expert id `first + e`), one main replica per expert-DP
        group. The default would store this rank's experts as if they were all of them."""
        ep_rank, ep_size = self.first // self.num_local, self.config.beam.num_experts // self.num_local
        return {f"{prefix}{name}": sharding.ep_sharded(getattr(self, name), f"{prefix}{name}", sharded_offsets,
                                                       ep_rank, ep_size)
                for name in ("gate_up_weight", "down_weight")}

    def combined(self, x, ids, weights, scaling: float) -> torch.Tensor:
        """All experts local (EP = 1): `bf16(scaling * sum_k y_k)` in slot order (`ops.grouped_experts`)."""
        gate_up, down = self.expert_weights()
        return ops.grouped_experts(x, ids, weights, gate_up, down, scaling, backend=self.config.kernel_backend)

    def pair_outputs(self, x, local_expert, weights) -> torch.Tensor:
        """Per (token, slot) pair routed to a local expert: `y = bf16(w * acc_fp32(down(bf16(silu(g) * u))))`
        (`numerics.expert_output`). x [m, H] (the pair's token), local_expert int [m] in [0, E_local), weights
        FP32 [m]. Returns [m, H] in x's dtype. With fused kernels: two `torch._grouped_mm` GEMMs, whose BF16 output
        rounds the down accumulator once before the weight (the deviation documented for
        `ops.grouped_experts(backend="triton")`)."""
        gate_up_weight, down_weight = self.expert_weights()
        I = gate_up_weight.shape[1] // 2
        order = torch.argsort(local_expert, stable=True)
        xs, es, ws = x[order], local_expert[order], weights[order]
        counts = torch.bincount(es, minlength=self.num_local)
        if self.config.use_fused_kernels:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gate_up = torch._grouped_mm(xs, gate_up_weight.transpose(-2, -1), offs=offs)
            act = numerics.swiglu(gate_up[:, :I], gate_up[:, I:])
            down = torch._grouped_mm(act, down_weight.transpose(-2, -1), offs=offs)
            ys = (down.float() * ws.float().unsqueeze(-1)).to(x.dtype)
        else:
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    gu = gate_up_weight[e]
                    parts.append(numerics.expert_output(xs[start:start + n], gu[:I], gu[I:], down_weight[e],
                                                        ws[start:start + n]))
                start += n
            ys = torch.cat(parts) if parts else x.new_zeros(0, x.shape[1])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return ys[inverse]

    def partial_fp32(self, x, ids, weights) -> torch.Tensor:
        """FP32 [T, H]: sum of `fp32(y_k)` over the (token, slot) pairs whose expert is local (ids are global;
        pairs of other EP ranks' experts, or -1, contribute nothing)."""
        local = ids - self.first
        tok, slot = torch.nonzero((local >= 0) & (local < self.num_local), as_tuple=True)
        y = self.pair_outputs(x[tok], local[tok, slot], weights[tok, slot])
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return out.index_add(0, tok, y.float())


class BeamMoELayer(MegatronModule):
    """Router + experts + combine for one MoE layer. Input/output `[s, b, h]` (this rank's SP tokens).

    Builder signature of Megatron's `MlpBuilder`; `set_layer_number` (called by `TransformerLayer`) tells the
    layer its global id, used to pick its column of `BeamPackedSeqParams.routes` / `recorded`."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, name=None, experts=None,
                 **_unused):
        """experts: builder `(config, num_local, first_expert)` of the experts module (default `BeamExperts`;
        the spec passes LoRA experts when experts are adapted)."""
        super().__init__(config=config)
        beam = config.beam
        self.scaling = beam.routed_scaling_factor
        self.ep_group = pg_collection.ep if pg_collection is not None else parallel_state.get_expert_model_parallel_group()
        self.tp_group = pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
        self.ep_size = self.ep_group.size()
        ep_rank = self.ep_group.rank()
        num_local = beam.num_experts // self.ep_size
        self.router = BeamRouter(config)
        self.experts = (experts or BeamExperts)(config, num_local, ep_rank * num_local)
        self.layer: Optional[int] = None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer = layer_number - 1

    def _forced_ids(self, params, n_local: int) -> Optional[torch.Tensor]:
        routes = getattr(params, "routes", None)
        if routes is None:
            return None
        beam = self.config.beam
        if routes.dim() != 3 or routes.shape[1:] != (beam.num_hidden_layers, beam.num_experts_per_tok):
            raise ValueError(f"routes must be [tokens, num_hidden_layers={beam.num_hidden_layers}, "
                             f"top_k={beam.num_experts_per_tok}], got {tuple(routes.shape)}")
        if self.config.sequence_parallel:
            tp, r = self.tp_group.size(), self.tp_group.rank()
            if routes.shape[0] != n_local * tp:
                raise ValueError(f"routes have {routes.shape[0]} token rows, expected {n_local * tp} "
                                 f"(tp={tp} x {n_local} local tokens) at layer {self.layer}")
            rows = routes[r * n_local:(r + 1) * n_local]
        else:
            if routes.shape[0] != n_local:
                raise ValueError(f"routes have {routes.shape[0]} token rows, expected {n_local} at layer {self.layer}")
            rows = routes
        return rows[:, self.layer]

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, **_unused) -> torch.Tensor:
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)  # Megatron token order: sequence-major [s, b]
        weights, ids = self.router(x, self._forced_ids(packed_seq_params, s * b))
        if getattr(packed_seq_params, "record", False):
            packed_seq_params.recorded[self.layer] = ids.detach().clone()
        if self.ep_size == 1:
            out = self.experts.combined(x, ids, weights, self.scaling)
        elif self.config.moe_token_dispatcher_type == "alltoall":
            out = self._expert_parallel_alltoall(x, ids, weights)
        else:
            out = self._expert_parallel(x, ids, weights)
        return out.view(s, b, h)

    def _expert_parallel_alltoall(self, x, ids, weights):
        """All-to-all exchange: each (token, slot) pair goes to its expert's EP rank and its BF16 output comes
        back, so the combine `bf16(2.5 * sum_k fp32(y_k))` runs in slot order, exactly as SGLang's."""
        n, k = ids.shape
        e_local = self.experts.num_local
        flat = ids.reshape(-1)
        dest = torch.div(flat, e_local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        in_splits, out_splits = send.tolist(), recv.tolist()
        tok = torch.div(order, k, rounding_mode="floor")
        x_recv = all_to_all(self.ep_group, x[tok], out_splits, in_splits)
        w_recv = all_to_all(self.ep_group, weights.reshape(-1, 1)[order], out_splits, in_splits).reshape(-1)
        e_send = (flat[order] - dest[order] * e_local).contiguous()
        e_recv = e_send.new_empty(sum(out_splits))
        dist.all_to_all_single(e_recv, e_send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=self.ep_group)
        y_back = all_to_all(self.ep_group, self.experts.pair_outputs(x_recv, e_recv, w_recv), in_splits, out_splits)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return numerics.moe_combine(y_back[inverse].view(n, k, -1), self.scaling)

    def _expert_parallel(self, x, ids, weights):
        n = x.shape[0]
        sizes = torch.tensor([n], dtype=torch.int64, device=x.device)  # NCCL reduces device tensors only
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.ep_group)
        m = int(sizes.item())
        pad = m - n
        if pad:  # padded rows: zero tokens routed to expert -1 (no local expert matches)
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), -1)])
            weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
        x_all = gather_from_sequence_parallel_region(x, True, group=self.ep_group)
        w_all = gather_from_sequence_parallel_region(weights, True, group=self.ep_group)
        ids_all = torch.empty(m * self.ep_size, ids.shape[1], dtype=ids.dtype, device=ids.device)
        dist.all_gather_into_tensor(ids_all, ids.contiguous(), group=self.ep_group)
        partial = self.experts.partial_fp32(x_all, ids_all, w_all)
        summed = reduce_scatter_to_sequence_parallel_region(partial, group=self.ep_group)[:n]
        return (summed * self.scaling).to(x.dtype)
