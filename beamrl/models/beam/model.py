"""`BeamForCausalLM`: the pure-PyTorch reference model of Beam (docs/model.md).

Parameter names are the HF names of `weights.expected_tensors`, so `state_dict()` is an SGLang-loadable
checkpoint dict. Every numeric step calls `numerics.py`, which holds SGLang's GPU rounding points
(beam-numerics.md §3); in float32 every rounding is the identity, which is what exactness tests use.

Batches are [B, T] with optional left/right padding (`attention_mask`, False = padding, never visible as a key)
and per-row positions; `cu_seqlens` selects packed (THD) mode on a [1, N] row. A `KVCache` makes decoding
incremental; it equals the full forward (see docs/model.md for the bf16 tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from beamrl.dtypes import dtype_name
from beamrl.models.beam import numerics
from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.kv_cache import KVCache
from beamrl.models.beam.weights import expected_tensors, packed_expert_names, random_state_dict

_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@dataclass
class BeamOutput:
    """logits: FP32 softcapped [B, T, V]; routes: int32 [B, T, L, k] (-1 on dense layers) or None; hidden: the
    final-norm hidden state that the LM head reads [B, T, H] (with `return_hidden`, else None)."""

    logits: torch.Tensor
    routes: torch.Tensor | None = None
    kv_cache: KVCache | None = None
    hidden: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return numerics.rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """Bias-free linear layer with uninitialised weight [out, in] (weights always come from a state dict;
    nn.Linear's random init would cost time and, on the meta device, a torch._refs import). An `nn.Linear` so
    that PEFT can put LoRA adapters on it (docs/lora.md)."""

    def __init__(self, n_in: int, n_out: int):
        nn.Module.__init__(self)  # not nn.Linear.__init__: no random init
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)



class BeamRouter(nn.Module):
    """`mlp.gate`: FP32 router weight [E, H] and FP32 correction bias [E] (selection only, not trained).

    Both stay FP32 whatever `.to(dtype)` the model receives, as in SGLang (beam-numerics.md §2)."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def _apply(self, fn, recurse=True):
        # Device moves still apply; dtype casts of the whole model must not demote the router.
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out.float() if out.is_floating_point() else out

        return super()._apply(keep_fp32, recurse)


class BeamExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(hidden, inter), Linear(hidden, inter), Linear(inter, hidden)


class BeamMLP(nn.Module):
    """Dense SwiGLU MLP with the single-rounded activation product (§3.9)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(hidden, inter), Linear(hidden, inter), Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(numerics.swiglu(self.gate_proj(x), self.up_proj(x)))


class BeamMoE(nn.Module):
    """Grouped sigmoid routing (FP32) + top-k experts, weighted in the down-GEMM epilogue, combined once (§3.10)."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.config = config
        self.gate = BeamRouter(config.num_experts, config.hidden_size)
        self.experts = nn.ModuleList(BeamExpert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self._capture_expert_params()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._capture_expert_params())

    def _capture_expert_params(self) -> None:
        """The experts' weight Parameters in the order the forward stacks them ([gate_0, up_0, gate_1, ...] and
        [down_0, ...]), looked up once: 3 x E module attribute lookups per forward were ~5% of a native-engine
        generate. The Parameter objects survive `.to()`, `.data` swaps (engine sleep/wake) and in-place loads;
        `_apply` and `load_state_dict` (which may replace them) capture them again. Code that assigns new expert
        Parameters by hand must call this too."""
        self._gate_up_params = [w for ex in self.experts for w in (ex.gate_proj.weight, ex.up_proj.weight)]
        self._down_params = [ex.down_proj.weight for ex in self.experts]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._capture_expert_params()
        return self

    def forward(self, x: torch.Tensor, forced_ids: torch.Tensor | None = None,
                forced_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (out [N, H], ids int64 [N, k]). `forced_ids` replace the selection on `forced_rows`
        (bool [N]); their weights come from the live router scores (R3 replay)."""
        c = self.config
        logits = numerics.router_logits(x, self.gate.weight)
        weights, ids = numerics.grouped_topk(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                                             c.n_group, c.topk_group)
        if forced_ids is not None:
            ids = torch.where(forced_rows.unsqueeze(-1), forced_ids.long(), ids)
            weights = numerics.routing_weights(torch.sigmoid(logits), ids)
        # Group the (token, slot) pairs by expert with one sort, run each expert on its contiguous segment.
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=c.num_experts).tolist()
        xs, ws = x.index_select(0, order // k), weights.reshape(-1).index_select(0, order)
        # [E, 2I, H]: gate_e then up_e per expert, from one stack of [gate_0, up_0, gate_1, up_1, ...].
        gate_up = torch.stack(self._gate_up_params)
        outs = numerics.grouped_expert_outputs(
            xs, counts, gate_up.view(c.num_experts, -1, gate_up.shape[-1]), torch.stack(self._down_params), ws)
        per_expert = torch.empty_like(outs).index_copy_(0, order, outs)
        return numerics.moe_combine(per_expert.view(n, k, -1), c.routed_scaling_factor), ids


class BeamAttention(nn.Module):
    """GQA with q/k-norm, RoPE (SWA layers) or SSMax (full layers), and the 3-rounding sigmoid output gate."""

    def __init__(self, config: BeamConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.sliding = layer, c.is_sliding(layer)
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj, self.k_proj, self.v_proj = Linear(c.hidden_size, q), Linear(c.hidden_size, kv), Linear(c.hidden_size, kv)
        self.gate_proj, self.o_proj = Linear(c.hidden_size, q), Linear(q, c.hidden_size)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)
        self.gate_bias = nn.Parameter(torch.empty(c.num_attention_heads))

    def forward(self, x: torch.Tensor, ctx: "_ForwardContext") -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        g = self.gate_proj(x).view(b, t, self.n_heads, self.head_dim)
        if self.sliding:
            q, k = numerics.apply_rope(q, ctx.cos, ctx.sin), numerics.apply_rope(k, ctx.cos, ctx.sin)
            mask = ctx.sliding_mask
        else:
            q = numerics.apply_ssmax(q, ctx.ssmax)
            mask = ctx.full_mask
        if ctx.cache is not None:
            k, v = ctx.cache.write(self.layer, ctx.slots, k, v)
        o = numerics.attention(q, k, v, mask)
        o = numerics.output_gate(o, g, self.gate_bias)
        return self.o_proj(o.reshape(b, t, self.n_heads * self.head_dim))


class BeamDecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP/MoE branches joined by depth-scaled residuals (§3.1, §3.8)."""

    def __init__(self, config: BeamConfig, layer: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer, self.is_moe = layer, config.is_moe(layer)
        self.attn_scales = config.residual_scales(layer, "attn")
        self.mlp_scales = config.residual_scales(layer, "mlp")
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn = BeamAttention(config, layer)
        self.mlp = BeamMoE(config) if self.is_moe else BeamMLP(H, config.intermediate_size)

    def forward(self, h: torch.Tensor, ctx: "_ForwardContext") -> tuple[torch.Tensor, torch.Tensor | None]:
        a = self.self_attn(self.input_layernorm(h), ctx)
        h = numerics.depth_scaled_residual(self.post_attention_layernorm(a), h, self.attn_scales)
        x = self.pre_feedforward_layernorm(h)
        ids = None
        if self.is_moe:
            b, t, H = x.shape
            forced = None if ctx.forced_routes is None else ctx.forced_routes[:, :, self.layer].reshape(b * t, -1)
            m, ids = self.mlp(x.reshape(b * t, H), forced, ctx.forced_rows)
            m, ids = m.view(b, t, H), ids.view(b, t, -1)
        else:
            m = self.mlp(x)
        return numerics.depth_scaled_residual(self.post_feedforward_layernorm(m), h, self.mlp_scales), ids


class BeamModel(nn.Module):
    def __init__(self, config: BeamConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BeamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class _ForwardContext:
    """Per-forward tensors shared by all layers (masks, RoPE tables, SSMax scales, cache slots, routes)."""

    sliding_mask: torch.Tensor
    full_mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    ssmax: torch.Tensor
    cache: KVCache | None
    slots: slice | None
    forced_routes: torch.Tensor | None
    forced_rows: torch.Tensor | None


class BeamForCausalLM(nn.Module):
    """Beam as SGLang serves it, in eager PyTorch. See docs/model.md.

    `BeamForCausalLM(config, dtype, device, seed)` initialises from `weights.random_state_dict(config, seed)`;
    `seed=None` leaves the weights uninitialised (for loading). The router stays FP32 in every dtype."""

    def __init__(self, config: BeamConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 seed: int | None = 0):
        super().__init__()
        self.config = config
        # Uninitialised FP32 storage on the target device (torch.empty; the meta device + to_empty would pull in
        # torch._refs and sympy, ~10 s), then the model dtype; the router stays FP32.
        with torch.device(device):
            self.model = BeamModel(config)
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.to(dtype)
        if seed is not None:
            self.load_hf_tensors(random_state_dict(config, seed, dtype), strict=True)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation/weight dtype (the router is FP32 regardless)."""
        return self.lm_head.weight.dtype

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> "BeamForCausalLM":
        """Load an SGLang-format Beam checkpoint (per-expert or packed experts), cast to `dtype` (router FP32)."""
        from beamrl.models.beam.checkpoint import load_checkpoint

        config, state = load_checkpoint(path)
        model = cls(config, dtype=dtype, device=device, seed=None)
        model.load_hf_tensors(state, strict=True)
        return model

    def save_pretrained(self, path: str | Path, expert_layout: str = "per_expert",
                        max_shard_bytes: int | None = None) -> list[Path]:
        """Write config.json (dtype = the model's) + safetensors in SGLang's names; returns the files written."""
        from beamrl.models.beam.checkpoint import save_checkpoint

        config = self.config.replace(dtype=dtype_name(self.dtype))
        return save_checkpoint(config, self.state_dict(), path, expert_layout=expert_layout,
                               max_shard_bytes=max_shard_bytes)

    def load_hf_tensors(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                        strict: bool = False) -> list[str]:
        """Copy HF-named tensors into the parameters in place; returns the per-expert names updated.

        Accepts packed expert names (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
        Every tensor is checked (known name, shape, router/bias FP32) before any is copied, so a bad input
        leaves the model untouched. `strict=True` also requires every parameter to be given."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        params = dict(self.named_parameters())
        staged: list[tuple[str, torch.Tensor]] = []
        for name, tensor in items:
            for pname, t in self._unpack(name, tensor):
                if pname not in params:
                    raise KeyError(f"unknown Beam tensor {pname!r} (not in the weight table of this config)")
                p = params[pname]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"tensor {pname!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                if pname.endswith(_FP32_SUFFIXES) and t.dtype != torch.float32:
                    raise ValueError(f"tensor {pname!r} must be float32 (router weight / correction bias), "
                                     f"got {t.dtype}; a {t.dtype} router loses precision")
                if not t.is_floating_point():
                    raise ValueError(f"tensor {pname!r} has non-float dtype {t.dtype}")
                staged.append((pname, t))
        if strict:
            missing = sorted(set(params) - {n for n, _ in staged})
            if missing:
                raise KeyError(f"{len(missing)} Beam tensors missing, e.g. {missing[:3]}")
        with torch.no_grad():
            for pname, t in staged:
                params[pname].copy_(t)
        return [n for n, _ in staged]

    def _unpack(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Split a packed expert tensor into per-expert (name, view) pairs; other names pass through."""
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return [(name, tensor)]
        c = self.config
        layer = int(name.split(".")[2])
        gate_up, down = packed_expert_names(layer)
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        expected = (E, 2 * I, H) if name == gate_up else (E, H, I)
        if tuple(tensor.shape) != expected or not c.is_moe(layer):
            raise ValueError(f"packed tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                             f"on a sparse layer")
        p = f"model.layers.{layer}.mlp.experts."
        if name == gate_up:
            return [pair for e in range(E) for pair in ((f"{p}{e}.gate_proj.weight", tensor[e, :I]),
                                                        (f"{p}{e}.up_proj.weight", tensor[e, I:]))]
        return [(f"{p}{e}.down_proj.weight", tensor[e]) for e in range(E)]

    def hf_names(self) -> list[str]:
        """The HF tensor names of this model (== `weights.expected_tensors(config)` keys)."""
        return list(expected_tensors(self.config))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                use_cache: bool = False, return_routes: bool = False, forced_routes: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, last_logits_only: bool = False,
                return_hidden: bool = False) -> BeamOutput:
        """Logits (and optionally routes) for `input_ids` [B, T].

        positions: [B, T] absolute positions; default = (real tokens already cached) + running count of real
          tokens - 1 per row, i.e. arange per row when there is no padding.
        attention_mask: [B, T] bool, False = padding (never visible as a key; its own outputs are garbage).
        kv_cache / use_cache: append to `kv_cache` (or a new one when `use_cache`) and attend to everything in it.
        forced_routes: [B, T, L, k] expert ids to use on MoE layers (dense-layer rows and padding ignored).
        cu_seqlens: [S+1] offsets of packed sequences in a [1, N] batch; attention never crosses sequences and
          positions restart at 0 per sequence.
        last_logits_only: compute the head only for the last position (logits [B, 1, V]; generation prefill).
        return_hidden: also return the final-norm hidden state (for heads applied elsewhere, e.g. TRL's fused one)."""
        c = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        dev = input_ids.device
        valid = (torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None
                 else attention_mask.to(device=dev, dtype=torch.bool))
        if valid.shape != (B, T):
            raise ValueError(f"attention_mask must be [B, T]={B, T}, got {tuple(valid.shape)}")
        segments = None
        if cu_seqlens is not None:
            segments, packed_pos = _packed_segments(cu_seqlens, B, T, dev)
            if kv_cache is not None or use_cache:
                raise ValueError("cu_seqlens (packed mode) cannot be combined with a KV cache")
            if positions is None:
                positions = packed_pos
        if kv_cache is None and use_cache:
            kv_cache = KVCache(c, B, T, self.dtype, dev)
        if positions is None:
            past = kv_cache.num_valid() if kv_cache is not None else torch.zeros(B, dtype=torch.long, device=dev)
            positions = (past.unsqueeze(1) + valid.long().cumsum(1) - 1).clamp(min=0)
        positions = positions.to(device=dev, dtype=torch.long)
        if positions.shape != (B, T):
            raise ValueError(f"positions must be [B, T]={B, T}, got {tuple(positions.shape)}")

        slots = None
        if kv_cache is not None:
            slots = kv_cache.append_meta(positions, valid)
            k_pos, k_valid = kv_cache.positions[:, : kv_cache.length], kv_cache.valid[:, : kv_cache.length]
            first_slot = slots.start
        else:
            k_pos, k_valid, first_slot = positions, valid, 0
        full = numerics.sliding_window_mask(positions, k_pos, None) & k_valid.unsqueeze(1)
        if segments is not None:
            full &= segments.unsqueeze(-1) == segments.unsqueeze(-2)
        sliding = full & numerics.sliding_window_mask(positions, k_pos, c.sliding_window)
        # A padding query may see no key at all; let it see itself so softmax stays finite (its output is unused).
        own = F.one_hot(first_slot + torch.arange(T, device=dev), k_pos.shape[1]).bool().unsqueeze(0)
        full = full | (own & ~full.any(-1, keepdim=True))
        sliding = sliding | (own & ~sliding.any(-1, keepdim=True))

        if forced_routes is not None:
            forced_routes = self._check_forced_routes(forced_routes, valid)
        cos, sin = numerics.rope_cos_sin(positions, c.head_dim, c.rope_theta)
        ctx = _ForwardContext(sliding, full, cos, sin, numerics.ssmax_scale(positions), kv_cache, slots,
                              forced_routes, None if forced_routes is None else valid.reshape(-1))

        h = self.model.embed_tokens(input_ids)
        routes = torch.full((B, T, c.num_hidden_layers, c.num_experts_per_tok), -1, dtype=torch.int32,
                            device=dev) if return_routes else None
        for layer in self.model.layers:
            h, ids = layer(h, ctx)
            if routes is not None and ids is not None:
                routes[:, :, layer.layer] = ids.to(torch.int32)
        if last_logits_only:
            h = h[:, -1:]
        hidden = self.model.norm(h)
        logits = numerics.softcap(self.lm_head(hidden), c.final_logit_softcapping)
        return BeamOutput(logits=logits, routes=routes, kv_cache=kv_cache, hidden=hidden if return_hidden else None)

    def _check_forced_routes(self, forced: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T = valid.shape
        want = (B, T, c.num_hidden_layers, c.num_experts_per_tok)
        if tuple(forced.shape) != want:
            raise ValueError(f"forced_routes must have shape {want}, got {tuple(forced.shape)}")
        forced = forced.to(device=valid.device, dtype=torch.long)
        moe = forced[:, :, c.moe_layers][valid]
        bad = (moe < 0) | (moe >= c.num_experts)
        if bad.any():
            raise ValueError(f"forced_routes holds expert ids outside [0, {c.num_experts}) on a real token of a "
                             f"MoE layer (e.g. {moe[bad][0].item()})")
        return forced

    @torch.no_grad()
    def token_logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0, **forward_kwargs) -> torch.Tensor:
        """FP32 [B, T-1]: log_softmax(softcapped logits / T)[t] gathered at input_ids[t+1].

        Extra keyword arguments go to `forward` (positions, attention_mask, forced_routes, cu_seqlens). In packed
        mode the entries predicting the first token of the next sequence are meaningless and set to 0."""
        logits = self.forward(input_ids, **forward_kwargs).logits[:, :-1]
        lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        cu = forward_kwargs.get("cu_seqlens")
        if cu is not None:
            ends = torch.as_tensor(cu, device=lp.device)[1:-1] - 1
            lp[:, ends] = 0.0
        return lp


def _packed_segments(cu_seqlens, B: int, T: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment id and per-sequence position of every token of a packed [1, N] batch."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long, device=dev)
    if B != 1:
        raise ValueError(f"cu_seqlens needs input_ids of shape [1, N], got batch {B}")
    if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != T or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must increase strictly from 0 to N={T}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    segments = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
    positions = torch.arange(T, device=dev) - cu[segments]
    return segments.unsqueeze(0), positions.unsqueeze(0)
