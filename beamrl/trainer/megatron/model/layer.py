"""Beam transformer layer: pre-norm attention and MLP, each followed by its sandwich post-norm and the
depth-scaled residual (beam-numerics §3.1, §3.8)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from beamrl.kernels import ops


@dataclass
class BeamTransformerLayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus Beam's two sandwich post-norms."""

    post_self_attn_layernorm: type = IdentityOp
    post_mlp_layernorm: type = IdentityOp


class BeamTransformerLayer(TransformerLayer):
    """`h = DSR(RMSNorm_post_attn(Attn(RMSNorm_in(h))), h, d=2m)`, then `h = DSR(RMSNorm_post_mlp(MLP(
    RMSNorm_pre_mlp(h))), h, d=2m+1)` with Megatron's global 1-based layer number m.

    The post-norm + residual + next pre-norm run as one `ops.post_norm_residual_pre_norm` (fused on GPU).
    Megatron's bias-dropout-add, cross attention and `fp32_residual_connection` are not used (the residual
    stream stays in the activation dtype)."""

    def __init__(self, config, submodules: BeamTransformerLayerSubmodules, layer_number: int = 1, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        beam = config.beam
        norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.post_self_attn_layernorm = submodules.post_self_attn_layernorm(**norm)
        self.post_mlp_layernorm = submodules.post_mlp_layernorm(**norm)
        layer = self.layer_number - 1
        self.attn_scales = beam.residual_scales(layer, "attn")
        self.mlp_scales = beam.residual_scales(layer, "mlp")

    def forward(self, hidden_states, attention_mask=None, context=None, packed_seq_params=None, **_unused):
        backend = self.config.kernel_backend
        eps = self.config.layernorm_epsilon
        attn_out, _ = self.self_attention(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                          packed_seq_params=packed_seq_params)
        hidden, mlp_in = ops.post_norm_residual_pre_norm(
            attn_out, hidden_states, self.post_self_attn_layernorm.weight, self.pre_mlp_layernorm.weight,
            self.attn_scales, eps, backend=backend)
        mlp_out = self.mlp(mlp_in, packed_seq_params=packed_seq_params)
        hidden, _ = ops.post_norm_residual_pre_norm(mlp_out, hidden, self.post_mlp_layernorm.weight, None,
                                                    self.mlp_scales, eps, backend=backend)
        return make_viewless_tensor(inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True), context
