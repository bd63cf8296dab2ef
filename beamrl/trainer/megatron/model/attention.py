"""Beam self-attention at spec level: fused QKV+gate projection, Q/K RMSNorm, FP32 RoPE (SWA layers) or SSMax
(full layers), packed (THD) causal attention with the sliding window, the per-head biased output gate, o_proj.

`linear_qkv` packs, per query group (KV head), `[q heads of the group, gate heads of the group, k, v]`, the
layout of Megatron's `SelfAttention` with `attention_output_gate=True` (transformer/attention.py:1678-1680,
split :1866-1890), so a TE/stock variant can share checkpoints. Each TP rank owns `num_kv_heads / tp` whole
groups. The fused ops come from `beamrl.kernels.ops` ("eager" on CPU, fused when
`config.use_fused_kernels`), so the GPU path plugs in without touching this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from beamrl.kernels import ops
from beamrl.models.beam import numerics
from beamrl.trainer.megatron.model import sharding
from beamrl.trainer.megatron.model.batch import positions_from_cu_seqlens


@dataclass
class BeamSelfAttentionSubmodules:
    """Builders of `BeamSelfAttention`'s parts (ColumnParallelLinear / RowParallelLinear / BeamRMSNorm /
    BeamCoreAttention on the local spec)."""

    linear_qkv: type
    core_attention: type
    linear_proj: type
    q_layernorm: type
    k_layernorm: type


class BeamCoreAttention(MegatronModule):
    """Packed causal GQA attention with an optional window: `beamrl.kernels.ops.attention`.

    q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int [B+1]; window = keys visible including self (None: full)."""

    def __init__(self, config, layer_number: int, **_unused):
        super().__init__(config=config)
        self.layer_number = layer_number

    def forward(self, q, k, v, cu_seqlens, window: Optional[int]):
        return ops.attention(q, k, v, cu_seqlens, window, backend=self.config.attention_backend_name)


class _SplitQGateKV(torch.autograd.Function):
    """(q [T, g*qpg, D], gate [T, g*qpg, D], k [T, g, D], v [T, g, D]) of the per-group packed projections
    tokens [T, g, 2*qpg + 2, D], as contiguous tensors. Sliced one by one, autograd would build a zero-filled
    gradient of all of `tokens` per part (four) and add them; here the four gradients are joined by one `cat`,
    plus 0 because that addition turned -0 into +0: the same gradient bit for bit."""

    @staticmethod
    def forward(ctx, tokens, qpg):
        ctx.qpg, ctx.shape = qpg, tokens.shape
        t, g, _, d = tokens.shape
        q = tokens[:, :, :qpg].reshape(t, g * qpg, d)
        gate = tokens[:, :, qpg:2 * qpg].reshape(t, g * qpg, d)
        k = tokens[:, :, 2 * qpg].contiguous()
        v = tokens[:, :, 2 * qpg + 1].contiguous()
        # reshape is a view when g == 1; a view of `tokens` itself is cloned. In the model `tokens` is already a
        # view of the projection's output, so the parts may share that memory, as plain slicing would (nothing
        # modifies them in place).
        return tuple(x.clone() if x._base is tokens or x is tokens else x for x in (q, gate, k, v))

    @staticmethod
    def backward(ctx, dq, dgate, dk, dv):
        qpg = ctx.qpg
        t, g, _, d = ctx.shape
        ref = next(x for x in (dq, dgate, dk, dv) if x is not None)  # dtype and device of the zero parts
        parts = [x.reshape(t, g, qpg, d) if x is not None else ref.new_zeros(t, g, qpg, d) for x in (dq, dgate)]
        parts += [x.unsqueeze(2) if x is not None else ref.new_zeros(t, g, 1, d) for x in (dk, dv)]
        return torch.cat(parts, dim=2).add_(0.0), None


class BeamSelfAttention(MegatronModule):
    """Beam attention for one layer (global 1-based `layer_number`). Input/output `[s, b, h]` (SP-sharded on s
    when sequence parallel: linear_qkv all-gathers, linear_proj reduce-scatters).

    Batch layout: with `packed_seq_params` (`BeamPackedSeqParams`, THD) b must be 1 and sequences are the
    cu_seqlens spans of s; without it each of the b columns is one sequence of length s. Positions restart at 0
    in every sequence (RoPE and SSMax)."""

    def __init__(self, config, submodules: BeamSelfAttentionSubmodules, layer_number: int, pg_collection=None,
                 **_unused):
        super().__init__(config=config)
        beam = config.beam
        self.layer_number = layer_number
        self.layer = layer_number - 1
        self.sliding = beam.is_sliding(self.layer)
        self.window = beam.sliding_window if self.sliding else None
        self.rope_theta = beam.rope_theta
        self.eps = beam.rms_norm_eps
        tp = config.tensor_model_parallel_size
        self.head_dim = beam.head_dim
        self.groups = divide(beam.num_key_value_heads, tp)
        self.q_per_group = beam.num_queries_per_kv
        self.heads = self.groups * self.q_per_group
        tp_group = pg_collection.tp if pg_collection is not None else None
        width = (2 * beam.num_attention_heads + 2 * beam.num_key_value_heads) * beam.head_dim
        self.linear_qkv = submodules.linear_qkv(
            beam.hidden_size, width, config=config, init_method=config.init_method, gather_output=False,
            bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv", tp_group=tp_group)
        self.q_layernorm = submodules.q_layernorm(config=config, hidden_size=beam.head_dim, eps=self.eps)
        self.k_layernorm = submodules.k_layernorm(config=config, hidden_size=beam.head_dim, eps=self.eps)
        self.core_attention = submodules.core_attention(config=config, layer_number=layer_number)
        self.linear_proj = submodules.linear_proj(
            beam.num_attention_heads * beam.head_dim, beam.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="proj", tp_group=tp_group)
        # Per-head gate bias in the activation dtype; each TP rank keeps its own heads.
        self.gate_bias = torch.nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.gate_bias, is_parallel=True, dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's default, except `gate_bias`: split over TP by heads (the default marks it replicated)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}gate_bias"
        sd[key] = sharding.tp_sharded(self.gate_bias, key, 0, sharded_offsets, metadata)
        return sd

    def _position_terms(self, packed_seq_params, cu: torch.Tensor, total: int):
        """RoPE (cos, sin) on sliding layers, SSMax scales on full ones, of the within-sequence positions. They
        depend on the micro-batch only, so every layer's forward (and a recompute) shares them through the
        micro-batch's `BeamPackedSeqParams.position_terms`."""
        key = ("rope", self.head_dim, self.rope_theta) if self.sliding else ("ssmax",)
        cache = getattr(packed_seq_params, "position_terms", None)
        if cache is not None and key in cache:
            return cache[key]
        pos = positions_from_cu_seqlens(cu, total)
        if self.sliding:
            terms = numerics.rope_cos_sin(pos, self.head_dim, self.rope_theta)
        else:
            terms = numerics.ssmax_scale(pos)
        if cache is not None:
            cache[key] = terms
        return terms

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_unused):
        if attention_mask is not None:
            raise ValueError("Beam attention takes no attention_mask (it would be ignored): pack the sequences and "
                             "pass packed_seq_params(cu_seqlens); padding is a sequence of its own")
        backend = self.config.kernel_backend
        qkv, _ = self.linear_qkv(hidden_states)
        s, b = qkv.shape[0], qkv.shape[1]
        d, g, qpg = self.head_dim, self.groups, self.q_per_group
        qkv = qkv.view(s, b, g, 2 * qpg + 2, d)
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q is not None:
            if b != 1:
                raise ValueError(f"packed (THD) batches need micro-batch dim 1, got hidden [s={s}, b={b}]")
            tokens = qkv.reshape(s, g, 2 * qpg + 2, d)
            cu = packed_seq_params.cu_seqlens_q.to(torch.int64)
        else:  # b sequences of length s: token order [b, s]
            tokens = qkv.transpose(0, 1).reshape(b * s, g, 2 * qpg + 2, d)
            cu = torch.arange(b + 1, device=qkv.device, dtype=torch.int64) * s
        T = tokens.shape[0]
        q, gate, k, v = _SplitQGateKV.apply(tokens, qpg)
        if self.sliding:
            cos, sin = self._position_terms(packed_seq_params, cu, T)
            q, k = ops.qk_norm_rope(q, k, self.q_layernorm.weight, self.k_layernorm.weight, cos, sin, self.eps,
                                    backend=backend)
        else:
            q, k = ops.qk_norm_ssmax(q, k, self.q_layernorm.weight, self.k_layernorm.weight,
                                     self._position_terms(packed_seq_params, cu, T), self.eps, backend=backend)
        o = self.core_attention(q, k, v, cu, self.window)
        o = ops.output_gate(o, gate, self.gate_bias, backend=backend)
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q is not None:
            o = o.reshape(s, 1, self.heads * d)
        else:
            o = o.reshape(b, s, self.heads * d).transpose(0, 1).contiguous()
        return self.linear_proj(o)
